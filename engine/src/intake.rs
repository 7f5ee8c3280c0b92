//! Intake: turning a `POST /v1/jobs` body into a validated [`NewJob`] and the
//! canonical hash that decides "identical resubmission" versus "conflict".
//!
//! Nothing here touches the database; the race between two submissions of one
//! id is decided by the store's `INSERT … ON CONFLICT`.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::workflow::{InvalidInput, Registry};

/// Longest accepted job id.
pub const MAX_ID_LEN: usize = 200;

/// A validated submission.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub id: String,
    pub workflow: String,
    pub input: Value,
    pub webhook_url: String,
}

impl NewJob {
    /// The request as stored (everything but the id, which is the key).
    pub fn request(&self) -> Value {
        serde_json::json!({
            "workflow": self.workflow,
            "input": self.input,
            "webhook_url": self.webhook_url,
        })
    }

    /// SHA-256 of the canonical request: equal exactly when two submissions
    /// are the same request, whatever their key order or whitespace.
    pub fn request_hash(&self) -> String {
        canonical_hash(&self.request())
    }
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntakeError {
    /// Not JSON at all (400).
    #[error("malformed JSON: {0}")]
    Malformed(String),
    /// JSON, but a field is missing or wrong (422).
    #[error("{0}")]
    Invalid(InvalidInput),
}

impl From<InvalidInput> for IntakeError {
    fn from(e: InvalidInput) -> Self {
        IntakeError::Invalid(e)
    }
}

/// Parses and validates a submission body against the registered workflows.
pub fn parse(body: &[u8], registry: &Registry) -> Result<NewJob, IntakeError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| IntakeError::Malformed(e.to_string()))?;
    let Value::Object(mut obj) = value else {
        return Err(InvalidInput::new("body", "must be a JSON object").into());
    };
    let id = take_string(&mut obj, "id")?;
    validate_id(&id)?;
    let workflow_name = take_string(&mut obj, "workflow")?;
    let Some(workflow) = registry.get(&workflow_name) else {
        let known: Vec<_> = registry.names().collect();
        return Err(InvalidInput::new(
            "workflow",
            format!(
                "unknown workflow {workflow_name:?}; registered: {}",
                known.join(", ")
            ),
        )
        .into());
    };
    let webhook_url = take_string(&mut obj, "webhook_url")?;
    validate_webhook_url(&webhook_url)?;
    let input = obj
        .remove("input")
        .ok_or_else(|| InvalidInput::new("input", "is required"))?;
    if !input.is_object() {
        return Err(InvalidInput::new("input", "must be a JSON object").into());
    }
    workflow.validate(&input)?;
    if let Some(extra) = obj.keys().next() {
        return Err(InvalidInput::new(extra.clone(), "unknown field").into());
    }
    Ok(NewJob {
        id,
        workflow: workflow_name,
        input,
        webhook_url,
    })
}

fn take_string(obj: &mut Map<String, Value>, field: &str) -> Result<String, InvalidInput> {
    match obj.remove(field) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(InvalidInput::new(field, "must be a string")),
        None => Err(InvalidInput::new(field, "is required")),
    }
}

/// A job id is 1–200 characters of `[A-Za-z0-9_.:-]` (the schema checks it too).
pub fn validate_id(id: &str) -> Result<(), InvalidInput> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(InvalidInput::new(
            "id",
            format!(
                "must be 1 to {MAX_ID_LEN} characters long (got {})",
                id.len()
            ),
        ));
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return Err(InvalidInput::new(
            "id",
            format!("may contain only A-Z a-z 0-9 _ . : - (found {bad:?})"),
        ));
    }
    Ok(())
}

fn validate_webhook_url(raw: &str) -> Result<(), InvalidInput> {
    let parsed = url::Url::parse(raw).map_err(|e| {
        InvalidInput::new(
            "webhook_url",
            format!("must be an absolute http(s) URL: {e}"),
        )
    })?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
        return Err(InvalidInput::new(
            "webhook_url",
            "must be an absolute http(s) URL with a host",
        ));
    }
    Ok(())
}

/// SHA-256 (hex) of `value` serialised canonically: object keys sorted,
/// no insignificant whitespace.
pub fn canonical_hash(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    hex::encode(Sha256::digest(out.as_bytes()))
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_hash_ignores_key_order_and_whitespace() {
        let a: Value = serde_json::from_str(r#"{"b":1,"a":{"y":[1,2],"x":"s"}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{ "a": {"x":"s", "y":[1, 2]}, "b": 1 }"#).unwrap();
        assert_eq!(canonical_hash(&a), canonical_hash(&b));
        let c = json!({"a": {"x": "s", "y": [2, 1]}, "b": 1});
        assert_ne!(canonical_hash(&a), canonical_hash(&c));
    }

    #[test]
    fn ids() {
        assert!(validate_id("order-42:v1.retry_3").is_ok());
        assert!(validate_id(&"a".repeat(200)).is_ok());
        assert!(validate_id(&"a".repeat(201)).is_err());
        assert!(validate_id("").is_err());
        assert!(validate_id("has space").is_err());
        assert!(validate_id("slash/no").is_err());
        assert!(validate_id("ünïcode").is_err());
    }

    #[test]
    fn webhook_urls() {
        assert!(validate_webhook_url("http://127.0.0.1:9/hook").is_ok());
        assert!(validate_webhook_url("https://example.com/h?x=1").is_ok());
        assert!(validate_webhook_url("/relative").is_err());
        assert!(validate_webhook_url("ftp://example.com/").is_err());
        assert!(validate_webhook_url("mailto:a@b.c").is_err());
    }
}
