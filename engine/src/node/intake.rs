//! Intake: turning a `POST /v1/jobs` body into a validated [`NewJob`] and the
//! canonical hash that decides "identical resubmission" versus "conflict".
//!
//! Nothing here touches the database; the race between two submissions of one
//! id is decided by the store's `INSERT … ON CONFLICT`.

use serde_json::{Map, Value};

use crate::net::guard::UrlGuard;
pub use crate::request::{canonical_hash, validate_webhook_url, NewJob, Schedule};
use crate::workflow::{InvalidInput, Registry};

/// Longest accepted job id.
pub const MAX_ID_LEN: usize = crate::request::MAX_JOB_ID_LEN;

/// Longest accepted `webhook_url`.
pub use crate::request::MAX_URL_LEN;

/// Longest accepted `delay_ms`, and how far ahead `run_at` may be: 30 days.
pub const MAX_DELAY_MS: u64 = 30 * 24 * 3600 * 1000;

/// The `priority` range open to a token that is not admin (an admin token
/// may use any `i32`): one tenant cannot push its jobs ahead of everything.
pub const MAX_TENANT_PRIORITY: i32 = 100;

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

/// Parses and validates a submission body against the registered workflows
/// and the SSRF guard.
pub fn parse(body: &[u8], registry: &Registry, guard: &UrlGuard) -> Result<NewJob, IntakeError> {
    let value = parse_json(body)?;
    if let Some(field) = find_nul(&value, "") {
        return Err(InvalidInput::new(
            field,
            "contains a NUL character (\\u0000), which onceflow cannot store",
        )
        .into());
    }
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
    // Optional: a job without one runs to `acked` with its result stored
    // and sends nothing (it is followed by GET, its events, or a wait).
    let webhook_url = match obj.remove("webhook_url") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(url)) => {
            validate_webhook_url(&url, guard)?;
            url
        }
        Some(_) => return Err(InvalidInput::new("webhook_url", "must be a string").into()),
    };
    let input = obj
        .remove("input")
        .ok_or_else(|| InvalidInput::new("input", "is required"))?;
    if !input.is_object() {
        return Err(InvalidInput::new("input", "must be a JSON object").into());
    }
    workflow.validate(&input)?;
    let mut schedule = take_schedule(&mut obj)?;
    schedule.concurrency_limit = workflow.concurrency_per_key();
    schedule.throttle = workflow.throttle_per_key();
    let tags = take_tags(&mut obj)?;
    if let Some(extra) = obj.keys().next() {
        return Err(InvalidInput::new(extra.clone(), "unknown field").into());
    }
    Ok(NewJob {
        tags,
        id,
        workflow_version: workflow.version() as i32,
        workflow: workflow_name,
        input,
        webhook_url,
        schedule,
    })
}

/// `tags`, optional: an object of at most 20 labels (1–64 characters of
/// `A-Z a-z 0-9 _ . -`), each a string of at most 256 characters.
fn take_tags(obj: &mut Map<String, Value>) -> Result<crate::request::Tags, InvalidInput> {
    use crate::request::{valid_tag_key, MAX_TAGS, MAX_TAG_VALUE};
    let tags = match obj.remove("tags") {
        None | Some(Value::Null) => return Ok(Default::default()),
        Some(Value::Object(tags)) => tags,
        Some(_) => return Err(InvalidInput::new("tags", "must be an object of strings")),
    };
    if tags.len() > MAX_TAGS {
        return Err(InvalidInput::new(
            "tags",
            format!("at most {MAX_TAGS} tags"),
        ));
    }
    let mut out = crate::request::Tags::new();
    for (key, value) in tags {
        if !valid_tag_key(&key) {
            return Err(InvalidInput::new(
                "tags",
                format!("label {key:?}: must be 1-64 characters of A-Z a-z 0-9 _ . -"),
            ));
        }
        match value {
            Value::String(v) if v.chars().count() <= MAX_TAG_VALUE => {
                out.insert(key, v);
            }
            _ => {
                return Err(InvalidInput::new(
                    format!("tags.{key}"),
                    format!("must be a string of at most {MAX_TAG_VALUE} characters"),
                ))
            }
        }
    }
    Ok(out)
}

/// `priority`, `run_at` and `delay_ms`, each optional; `run_at` and
/// `delay_ms` not both.
fn take_schedule(obj: &mut Map<String, Value>) -> Result<Schedule, InvalidInput> {
    // `null` is the field's absence, as the OpenAPI document says.
    let priority = match obj.remove("priority") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| {
                InvalidInput::new("priority", "must be an integer (higher runs first)")
            })?,
    };
    let run_at = match obj.remove("run_at") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(
            chrono::DateTime::parse_from_rfc3339(&s)
                .map_err(|_| {
                    InvalidInput::new("run_at", "must be an RFC 3339 time (2026-12-01T10:00:00Z)")
                })?
                .with_timezone(&chrono::Utc),
        ),
        Some(_) => return Err(InvalidInput::new("run_at", "must be a string (RFC 3339)")),
    };

    let delay_ms = match obj.remove("delay_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|ms| *ms <= MAX_DELAY_MS).ok_or_else(|| {
            InvalidInput::new(
                "delay_ms",
                format!("must be an integer from 0 to {MAX_DELAY_MS} (30 days)"),
            )
        })?),
    };
    if run_at.is_some() && delay_ms.is_some() {
        return Err(InvalidInput::new(
            "delay_ms",
            "give run_at or delay_ms, not both",
        ));
    }
    let latest = chrono::Utc::now() + chrono::Duration::milliseconds(MAX_DELAY_MS as i64);
    if run_at.is_some_and(|at| at > latest) {
        return Err(InvalidInput::new(
            "run_at",
            "must be at most 30 days ahead (as delay_ms)",
        ));
    }
    let concurrency_key = match obj.remove("concurrency_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(k))
            if !k.is_empty() && k.chars().count() <= crate::request::MAX_CONCURRENCY_KEY =>
        {
            Some(k)
        }
        Some(_) => {
            return Err(InvalidInput::new(
                "concurrency_key",
                format!(
                    "must be a string of 1 to {} characters",
                    crate::request::MAX_CONCURRENCY_KEY
                ),
            ))
        }
    };
    Ok(Schedule {
        priority,
        run_at,
        delay_ms,
        concurrency_key,
        concurrency_limit: None,
        throttle: None,
    })
}

/// Parses JSON, refusing an object with the same key twice (which parsers
/// resolve differently: one would see another request than the other).
pub fn parse_json(body: &[u8]) -> Result<Value, IntakeError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = <Strict as serde::Deserialize>::deserialize(&mut de)
        .map_err(|e| IntakeError::Malformed(e.to_string()))?;
    de.end()
        .map_err(|e| IntakeError::Malformed(e.to_string()))?;
    Ok(value.0)
}

/// A JSON value whose objects have distinct keys.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut obj = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(value) = map.next_value()?;
            if obj.insert(key.clone(), value).is_some() {
                return Err(serde::de::Error::custom(format!(
                    "duplicate key {key:?} in an object"
                )));
            }
        }
        Ok(Value::Object(obj))
    }
}

/// The path (`input.messages[0].content`) of the first string or key that
/// holds a NUL character.
fn find_nul(value: &Value, path: &str) -> Option<String> {
    let here = |p: &str| {
        if p.is_empty() {
            "body".to_owned()
        } else {
            p.to_owned()
        }
    };
    match value {
        Value::String(s) if s.contains('\0') => Some(here(path)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| find_nul(v, &format!("{path}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let child = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            if k.contains('\0') {
                Some(child)
            } else {
                find_nul(v, &child)
            }
        }),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => None,
    }
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
    if id.contains(":child:") || id.contains(":child.") {
        return Err(InvalidInput::new(
            "id",
            "ids containing :child: or :child. are reserved for the child jobs workflows start \
             ({parent id}:child:{name}, {parent id}:child.{n}:{name})",
        ));
    }
    if crate::rules::schedule::is_scheduled_job_id(id) {
        return Err(InvalidInput::new(
            "id",
            "ids of the form {schedule id}:{YYYYMMDDTHHMMSSZ} are reserved for the jobs schedules create",
        ));
    }
    Ok(())
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

    /// Stored hashes are compared with later submissions of the same id,
    /// across upgrades: the canonical form must never change. (Its bytes,
    /// here, and their SHA-256 were computed independently of this code.)
    #[test]
    fn canonical_hash_is_pinned() {
        let v = json!({"b": -1, "a": {"y": [1, 2.5, null, true], "x": "s\u{e9}\n"}});
        assert_eq!(
            canonical_hash(&v),
            "b240e2d053964985c3ee0c6a7cdc2bea0755c7f43509c3e2da95119ab2d54dfa"
        );
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
        // The child jobs' forms, of every incarnation of a parent.
        assert!(validate_id("a:child:b").is_err());
        assert!(validate_id("a:child.2:b").is_err());
        assert!(validate_id("a:children").is_ok());
    }

    #[test]
    fn webhook_urls() {
        let open = UrlGuard::allow_private();
        let strict = UrlGuard::strict();
        assert!(validate_webhook_url("http://127.0.0.1:9/hook", &open).is_ok());
        assert!(validate_webhook_url("http://127.0.0.1:9/hook", &strict).is_err());
        assert!(validate_webhook_url("http://2130706433/", &strict).is_err());
        assert!(validate_webhook_url("https://example.com/h?x=1", &strict).is_ok());
        assert!(validate_webhook_url("/relative", &open).is_err());
        assert!(validate_webhook_url("ftp://example.com/", &open).is_err());
        assert!(validate_webhook_url("mailto:a@b.c", &open).is_err());
        assert!(validate_webhook_url("https://u:p@example.com/", &open).is_err());
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        assert!(validate_webhook_url(&long, &open).is_err());
    }

    #[test]
    fn duplicate_keys_are_malformed_and_nul_is_found_by_path() {
        assert!(parse_json(br#"{"a": 1, "b": {"c": 2}}"#).is_ok());
        let dup = parse_json(br#"{"a": 1, "b": {"c": 2, "c": 3}}"#).unwrap_err();
        assert!(matches!(dup, IntakeError::Malformed(ref m) if m.contains("duplicate key")));
        assert!(parse_json(br#"{"a": 1} trailing"#).is_err());
        let v =
            serde_json::json!({"input": {"messages": [{"content": "ok"}, {"content": "a\u{0}b"}]}});
        assert_eq!(
            find_nul(&v, "").as_deref(),
            Some("input.messages[1].content")
        );
        assert_eq!(find_nul(&serde_json::json!({"x": "fine"}), ""), None);
    }
}
