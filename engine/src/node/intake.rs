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

// The body as it is parsed and as the OpenAPI document describes it: one
// type for both, so the document cannot drift from the server; `validate`
// checks what a type cannot say and makes the `NewJob`.
/// `POST /v1/jobs`: one job (also each job of a batch).
#[derive(Debug, Clone, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitJob {
    /// The job id, your business id: 1–200 characters of `A-Z a-z 0-9 _ . : -`.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
    pub id: String,
    /// A registered workflow: `completion`, `agent`, or your own.
    pub workflow: String,
    /// The workflow's input: for `completion`, `{"model", "messages",
    /// "stream"?, "provider"?, …}`; for `agent`, `{"model", "messages",
    /// "max_turns"?, "approval"?, …}` (see the guide).
    #[schema(value_type = Object)]
    pub input: Value,
    /// Where the outcome is POSTed (Standard Webhooks): an http(s) URL of a
    /// public address (a name is resolved and checked). Without it the job
    /// runs to `acked` with its result stored and nothing is POSTed.
    #[schema(format = "uri", pattern = "^https?://")]
    pub webhook_url: Option<String>,
    /// Higher runs first among the due jobs of its tenant (-100 to 100 for
    /// a tenant's token). Between tenants, weighted turns decide; only an
    /// admin token's priority cuts across them.
    pub priority: Option<i32>,
    /// A key of yours (a customer, a conversation): at most the limit
    /// (the smaller of the token's `--key-concurrency` and the workflow's,
    /// else the one set, else 1) of this token's jobs with the same key run
    /// at once, across every node. The limit is fixed at intake; a job
    /// starts only while fewer than its own limit of the key's jobs run.
    /// The others wait, shown as `waiting: {"kind": "concurrency", "key"}`.
    /// A throttle (the token's `--key-throttle`, or the workflow's; with
    /// both, the fewer starts over the longer period) also bounds how many
    /// of the key's jobs start per
    /// period: the rest wait, shown as `waiting: {"kind": "throttle",
    /// "key", "until"}` (never a 429).
    #[schema(min_length = 1, max_length = 200)]
    pub concurrency_key: Option<String>,
    /// Labels to list and cancel jobs by (`?tag=label:value`): at most 20,
    /// each label 1–64 characters of `A-Z a-z 0-9 _ . -`, each value a
    /// string of at most 256 characters.
    #[schema(value_type = Option<HashMap<String, String>>)]
    pub tags: Option<std::collections::BTreeMap<String, String>>,
    /// Not before this time (RFC 3339, at most 30 days ahead).
    #[serde(default, deserialize_with = "rfc3339")]
    pub run_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Not before this many milliseconds (at most 30 days); not with `run_at`.
    #[schema(maximum = 2_592_000_000_u64)]
    pub delay_ms: Option<u64>,
}

/// An optional RFC 3339 time, strictly (chrono's own parser also takes a
/// space for the `T` and other forms the document does not allow).
fn rfc3339<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, D::Error> {
    let Some(text) = <Option<String> as serde::Deserialize>::deserialize(d)? else {
        return Ok(None);
    };
    chrono::DateTime::parse_from_rfc3339(&text)
        .map(|t| Some(t.with_timezone(&chrono::Utc)))
        .map_err(|_| serde::de::Error::custom("must be an RFC 3339 time (2026-12-01T10:00:00Z)"))
}

/// Parses and validates a submission body against the registered workflows
/// and the SSRF guard.
pub fn parse(body: &[u8], registry: &Registry, guard: &UrlGuard) -> Result<NewJob, IntakeError> {
    let job: SubmitJob = typed(parse_json(body)?)?;
    Ok(validate(job, registry, guard)?)
}

/// `value` as a `T`, or the field at fault: a string or key holding a NUL
/// (which PostgreSQL cannot store), an unknown field, a missing one, or one
/// of the wrong type, each named by its path (`input.messages[1].content`,
/// `tags.team`, `priority`).
pub fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, InvalidInput> {
    if let Some(field) = find_nul(&value, "") {
        return Err(InvalidInput::new(
            field,
            "contains a NUL character (\\u0000), which onceflow cannot store",
        ));
    }
    if !value.is_object() {
        return Err(InvalidInput::new("body", "must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // serde names an unknown or missing field in its message, at the
        // path of the object that holds it.
        let named = ["unknown field `", "missing field `"]
            .iter()
            .find_map(|p| message.strip_prefix(p))
            .and_then(|rest| rest.split_once('`'))
            .map(|(name, _)| name.to_owned());
        // (An unknown field's path ends with its name already.)
        let within = |name: &str| {
            if path == "." || path.is_empty() {
                name.to_owned()
            } else if path == name || path.ends_with(&format!(".{name}")) {
                path.clone()
            } else {
                format!("{path}.{name}")
            }
        };
        match named {
            Some(name) if message.starts_with("unknown") => {
                InvalidInput::new(within(&name), "unknown field")
            }
            Some(name) => InvalidInput::new(within(&name), "is required"),
            None if path == "." || path.is_empty() => InvalidInput::new("body", message),
            None => InvalidInput::new(path, message),
        }
    })
}

/// A parsed submission checked as a type cannot check it: the id, the
/// workflow registered and its input, the webhook URL's guard, the
/// schedule (`run_at` or `delay_ms`, the key), the tags.
pub fn validate(
    job: SubmitJob,
    registry: &Registry,
    guard: &UrlGuard,
) -> Result<NewJob, InvalidInput> {
    validate_id(&job.id)?;
    let Some(workflow) = registry.get(&job.workflow) else {
        let known: Vec<_> = registry.names().collect();
        return Err(InvalidInput::new(
            "workflow",
            format!(
                "unknown workflow {:?}; registered: {}",
                job.workflow,
                known.join(", ")
            ),
        ));
    };
    // Optional: a job without one runs to `acked` with its result stored
    // and sends nothing (it is followed by GET, its events, or a wait).
    let webhook_url = match job.webhook_url {
        None => String::new(),
        Some(url) => {
            validate_webhook_url(&url, guard)?;
            url
        }
    };
    if !job.input.is_object() {
        return Err(InvalidInput::new("input", "must be a JSON object"));
    }
    workflow.validate(&job.input)?;
    let mut schedule = schedule_of(job.priority, job.run_at, job.delay_ms, job.concurrency_key)?;
    schedule.concurrency_limit = workflow.concurrency_per_key();
    schedule.throttle = workflow.throttle_per_key();
    let tags = tags_of(job.tags.unwrap_or_default())?;
    Ok(NewJob {
        tags,
        id: job.id,
        workflow_version: workflow.version() as i32,
        workflow: job.workflow,
        input: job.input,
        webhook_url,
        schedule,
    })
}

/// `tags`: at most 20 labels (1–64 characters of `A-Z a-z 0-9 _ . -`),
/// each a string of at most 256 characters.
fn tags_of(
    tags: std::collections::BTreeMap<String, String>,
) -> Result<crate::request::Tags, InvalidInput> {
    use crate::request::{valid_tag_key, MAX_TAGS, MAX_TAG_VALUE};
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
        if value.chars().count() > MAX_TAG_VALUE {
            return Err(InvalidInput::new(
                format!("tags.{key}"),
                format!("must be a string of at most {MAX_TAG_VALUE} characters"),
            ));
        }
        out.insert(key, value);
    }
    Ok(out)
}

/// `priority`, `run_at`, `delay_ms` and `concurrency_key`, each optional;
/// `run_at` and `delay_ms` not both.
fn schedule_of(
    priority: Option<i32>,
    run_at: Option<chrono::DateTime<chrono::Utc>>,
    delay_ms: Option<u64>,
    concurrency_key: Option<String>,
) -> Result<Schedule, InvalidInput> {
    if delay_ms.is_some_and(|ms| ms > MAX_DELAY_MS) {
        return Err(InvalidInput::new(
            "delay_ms",
            format!("must be an integer from 0 to {MAX_DELAY_MS} (30 days)"),
        ));
    }
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
    if concurrency_key
        .as_ref()
        .is_some_and(|k| k.is_empty() || k.chars().count() > crate::request::MAX_CONCURRENCY_KEY)
    {
        return Err(InvalidInput::new(
            "concurrency_key",
            format!(
                "must be a string of 1 to {} characters",
                crate::request::MAX_CONCURRENCY_KEY
            ),
        ));
    }
    Ok(Schedule {
        priority: priority.unwrap_or(0),
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
