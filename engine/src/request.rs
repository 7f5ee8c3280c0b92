//! The typed job request: what intake builds from a `POST /v1/jobs` body,
//! what the store keeps in `jobs.request` (and hashes to tell an identical
//! resubmission from a conflict), and what the actor reads back to run the
//! job. One type on every hop in Rust; the SQL that sends failure events
//! reads `request->>'webhook_url'`, so the field names are durable.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Longest accepted `webhook_url`.
pub const MAX_URL_LEN: usize = 2048;

/// Longest job id (the schema checks it too).
pub const MAX_JOB_ID_LEN: usize = 200;

/// A validated submission.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    /// The job id: the client's business id, and the job's primary key.
    pub id: String,
    /// The name of the workflow to run.
    pub workflow: String,
    /// The version of the workflow the job starts on (the highest this node
    /// registers). Not part of the request: resubmitting a job after a deploy
    /// is still the same request.
    pub workflow_version: i32,
    /// The workflow's input, as submitted (validated by the workflow).
    pub input: Value,
    /// Where the outcome is delivered by webhook (checked by the SSRF guard).
    pub webhook_url: String,
    /// When and in what order it runs.
    pub schedule: Schedule,
    /// Labels to list and act on jobs by (`?tag=k:v`), at most
    /// [`MAX_TAGS`]; part of the request.
    pub tags: Tags,
}

/// A job's tags: label → value.
pub type Tags = std::collections::BTreeMap<String, String>;

/// Most tags on one job.
pub const MAX_TAGS: usize = 20;

/// Longest tag label (1–64 characters of `A-Z a-z 0-9 _ . -`).
pub const MAX_TAG_KEY: usize = 64;

/// Longest tag value.
pub const MAX_TAG_VALUE: usize = 256;

/// Whether `key` may label a tag: 1–64 characters of `A-Z a-z 0-9 _ . -`
/// (no `:`, which separates label and value in `?tag=k:v`).
pub fn valid_tag_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_TAG_KEY
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// When a job may start, and which goes first when jobs wait.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Higher first among jobs that are due (default 0).
    pub priority: i32,
    /// Not before this time (`run_at`, RFC 3339).
    pub run_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Not before this long after intake (`delay_ms`).
    pub delay_ms: Option<u64>,
    /// The caller's key (a customer, a conversation): at most
    /// `concurrency_limit` jobs of one key of one tenant run at once.
    pub concurrency_key: Option<String>,
    /// The workflow's limit per key ([`Workflow::concurrency_per_key`](crate::Workflow::concurrency_per_key)),
    /// filled in by intake; not part of the request.
    pub concurrency_limit: Option<u32>,
    /// The workflow's throttle per key ([`Workflow::throttle_per_key`](crate::Workflow::throttle_per_key)),
    /// filled in by intake; not part of the request.
    pub throttle: Option<Throttle>,
}

/// At most `starts` jobs of one concurrency key start in any `per`: a
/// job's first start counts, its retries and takeovers do not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    /// Starts allowed per period (1–1000).
    pub starts: u32,
    /// The period (1 s to 1 day, whole seconds).
    pub per: std::time::Duration,
}

impl Throttle {
    /// `starts` per `per`, each brought into its bounds (1–1000 starts;
    /// 1 s to 1 day, whole seconds).
    pub fn new(starts: u32, per: std::time::Duration) -> Self {
        Throttle {
            starts: starts.clamp(1, 1000),
            per: std::time::Duration::from_secs(per.as_secs().clamp(1, 86_400)),
        }
    }
}

/// Longest `concurrency_key`, in characters.
pub const MAX_CONCURRENCY_KEY: usize = 200;

/// The request as stored in `jobs.request` (everything but the id, which is
/// the key). The schedule's fields appear only when given, so a request
/// without them hashes as it always did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct JobRequest {
    /// The name of the workflow to run.
    #[serde(deserialize_with = "lenient")]
    pub workflow: String,
    /// The workflow's input.
    pub input: Value,
    /// Where the outcome is delivered.
    #[serde(deserialize_with = "lenient")]
    pub webhook_url: String,
    /// Higher first among due jobs; stored only when not 0.
    #[serde(skip_serializing_if = "is_zero", deserialize_with = "lenient")]
    pub priority: i32,
    /// Not before this time; stored (and hashed) as `to_rfc3339()` writes it.
    #[serde(skip_serializing_if = "Option::is_none", with = "rfc3339")]
    pub run_at: Option<DateTime<Utc>>,
    /// Not before this long after intake.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient")]
    pub delay_ms: Option<u64>,
    /// Its tags; stored only when there are some.
    #[serde(skip_serializing_if = "Tags::is_empty", deserialize_with = "lenient")]
    pub tags: Tags,
    /// Its concurrency key; stored only when given.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "lenient")]
    pub concurrency_key: Option<String>,
}

/// A stored field read as its type, or its default when a hand-edited row
/// holds something else there: one damaged field does not cost the others.
fn lenient<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned + Default,
{
    let value = Value::deserialize(d)?;
    Ok(serde_json::from_value(value).unwrap_or_default())
}

fn is_zero(p: &i32) -> bool {
    *p == 0
}

/// `run_at` as the store has always written it (`+00:00`, not `Z`): the
/// request hash of a job stored before this type existed stays the same.
mod rfc3339 {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(at: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match at {
            Some(at) => s.serialize_str(&at.to_rfc3339()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| {
                DateTime::parse_from_rfc3339(&s)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
    }
}

impl JobRequest {
    /// The request of a stored row. A field that no longer reads as its type
    /// (a hand-edited row, say) reads as empty, and the others as stored; a
    /// request that is not an object at all reads as empty, and its
    /// workflow then refuses the `null` input: the job dies with that reason.
    pub fn from_stored(value: Value) -> JobRequest {
        serde_json::from_value(value).unwrap_or_default()
    }

    /// The request as the JSON stored in `jobs.request`.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("a request serialises")
    }

    /// SHA-256 of the canonical request: equal exactly when two submissions
    /// are the same request, whatever their key order or whitespace.
    pub fn hash(&self) -> String {
        canonical_hash(&self.to_value())
    }
}

impl NewJob {
    /// The request as stored (everything but the id, which is the key).
    pub fn request(&self) -> JobRequest {
        JobRequest {
            workflow: self.workflow.clone(),
            input: self.input.clone(),
            webhook_url: self.webhook_url.clone(),
            priority: self.schedule.priority,
            run_at: self.schedule.run_at,
            delay_ms: self.schedule.delay_ms,
            tags: self.tags.clone(),
            concurrency_key: self.schedule.concurrency_key.clone(),
        }
    }

    /// SHA-256 of the canonical request (see [`JobRequest::hash`]).
    pub fn request_hash(&self) -> String {
        self.request().hash()
    }
}

/// SHA-256 (hex) of `value` serialised canonically: object keys sorted,
/// no insignificant whitespace.
pub fn canonical_hash(value: &Value) -> String {
    let mut out = Vec::with_capacity(256);
    write_canonical(value, &mut out);
    hex::encode(Sha256::digest(&out))
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, k).expect("writing to memory");
                out.push(b':');
                write_canonical(&map[k], out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to memory"),
    }
}

/// A `webhook_url`: an absolute http(s) URL of at most [`MAX_URL_LEN`]
/// characters, without credentials, that `guard` allows.
pub fn validate_webhook_url(
    raw: &str,
    guard: &crate::net::guard::UrlGuard,
) -> Result<(), crate::error::InvalidInput> {
    if raw.len() > MAX_URL_LEN {
        return Err(crate::error::InvalidInput::new(
            "webhook_url",
            format!(
                "must be at most {MAX_URL_LEN} characters (got {})",
                raw.len()
            ),
        ));
    }
    let parsed = url::Url::parse(raw).map_err(|e| {
        crate::error::InvalidInput::new(
            "webhook_url",
            format!("must be an absolute http(s) URL: {e}"),
        )
    })?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
        return Err(crate::error::InvalidInput::new(
            "webhook_url",
            "must be an absolute http(s) URL with a host",
        ));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(crate::error::InvalidInput::new(
            "webhook_url",
            "must not carry credentials (user:password@)",
        ));
    }
    guard
        .check(&parsed)
        .map_err(|r| crate::error::InvalidInput::new("webhook_url", r.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn old_request(job: &NewJob) -> Value {
        // The request as the store wrote it before this type: the hash of a
        // stored job must not change under it.
        let mut r = serde_json::Map::new();
        r.insert("workflow".into(), job.workflow.clone().into());
        r.insert("input".into(), job.input.clone());
        r.insert("webhook_url".into(), job.webhook_url.clone().into());
        if job.schedule.priority != 0 {
            r.insert("priority".into(), job.schedule.priority.into());
        }
        if let Some(at) = job.schedule.run_at {
            r.insert("run_at".into(), at.to_rfc3339().into());
        }
        if let Some(ms) = job.schedule.delay_ms {
            r.insert("delay_ms".into(), ms.into());
        }
        Value::Object(r)
    }

    #[test]
    fn the_typed_request_stores_and_hashes_as_the_untyped_one_did() {
        let at = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        for schedule in [
            Schedule::default(),
            Schedule {
                priority: -3,
                run_at: Some(at),
                delay_ms: None,
                ..Default::default()
            },
            Schedule {
                priority: 0,
                run_at: None,
                delay_ms: Some(1500),
                ..Default::default()
            },
        ] {
            let job = NewJob {
                tags: Default::default(),
                id: "j".into(),
                workflow: "completion".into(),
                workflow_version: 1,
                input: json!({"prompt": "hi", "n": [1, 2]}),
                webhook_url: "https://example.com/h".into(),
                schedule,
            };
            let stored = job.request().to_value();
            assert_eq!(stored, old_request(&job));
            assert_eq!(job.request_hash(), canonical_hash(&old_request(&job)));
            assert_eq!(JobRequest::from_stored(stored), job.request());
        }
    }

    #[test]
    fn a_damaged_stored_field_costs_only_itself() {
        let r = JobRequest::from_stored(json!({
            "workflow": "completion", "input": {"a": 1}, "webhook_url": 7, "priority": "high"
        }));
        assert_eq!(r.workflow, "completion");
        assert_eq!(r.input, json!({"a": 1}));
        assert_eq!((r.webhook_url.as_str(), r.priority), ("", 0));
        assert_eq!(
            JobRequest::from_stored(json!("not an object")),
            JobRequest::default()
        );
    }
}
