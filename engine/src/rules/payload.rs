//! What a stored JSON value may hold: PostgreSQL's `jsonb` and `text`
//! reject the NUL character, so every caller- or model-given value is
//! checked before it is written, and refused with a clear error naming its
//! field rather than failing the statement.

/// Whether `v` holds a NUL character anywhere (PostgreSQL's `jsonb` and
/// `text` reject it).
pub fn contains_nul(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(contains_nul),
        serde_json::Value::Object(map) => {
            map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v))
        }
        serde_json::Value::Null | serde_json::Value::Bool(_) | serde_json::Value::Number(_) => {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_characters_are_found_anywhere() {
        assert!(!contains_nul(
            &serde_json::json!({"a": ["b", 1, null, {"c": "d"}]})
        ));
        assert!(contains_nul(
            &serde_json::json!({"a": ["b", {"c": "d\u{0}"}]})
        ));
        assert!(contains_nul(&serde_json::json!({"a\u{0}": 1})));
    }
}
