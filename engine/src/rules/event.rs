//! The events a job sends its consumer, as values: the Standard Webhooks
//! envelope (`{"type", "timestamp", "data"}`), the completion event's body,
//! and a new signing secret. Built with no I/O: the time is the caller's,
//! so one body is the same bytes on every attempt, and the store binds it
//! as a parameter where it queues an event in SQL (`job.dead`,
//! `job.cancelled`, `job.waiting`).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::rules::keys::COMPLETED_EVENT;

/// An event's body in the Standard Webhooks envelope, `timestamp` the
/// event's time `at` (RFC 3339, UTC, microseconds). Built once, when the
/// event is claimed: every attempt resends the same bytes (only the
/// `webhook-timestamp` header is the attempt's). The one place the envelope
/// is built (`security::tenant_webhooks_and_events_pass_the_reference_library_across_a_rotation`
/// checks a completion and an event queued in SQL).
pub fn body(event: &str, data: Value, at: DateTime<Utc>) -> Value {
    let mut body = serde_json::Map::new();
    body.insert("type".into(), event.into());
    body.insert(
        "timestamp".into(),
        at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
            .into(),
    );
    body.insert("data".into(), data);
    Value::Object(body)
}

/// The completion event's body: `data` is `{"job_id", "result"}`.
pub fn completed(job_id: &str, result: &Value, at: DateTime<Utc>) -> Value {
    // Built directly: `json!` would serialise `result` into a new value.
    let mut data = serde_json::Map::new();
    data.insert("job_id".into(), job_id.into());
    data.insert("result".into(), result.clone());
    body(COMPLETED_EVENT, Value::Object(data), at)
}

/// A new signing secret: `whsec_` + base64 of 32 random bytes.
pub fn new_secret() -> String {
    let key: [u8; 32] = rand::random();
    format!("whsec_{}", B64.encode(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_envelope_has_the_type_the_time_and_the_data() {
        let at = DateTime::parse_from_rfc3339("2026-12-06T10:00:00.5Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            completed("order-1", &json!({ "text": "hi" }), at),
            json!({
                "type": "job.completed",
                "timestamp": "2026-12-06T10:00:00.500000Z",
                "data": { "job_id": "order-1", "result": { "text": "hi" } },
            })
        );
        assert_eq!(
            body("job.dead", json!({}), at)["timestamp"],
            "2026-12-06T10:00:00.500000Z"
        );
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        let key = B64.decode(a.strip_prefix("whsec_").unwrap()).unwrap();
        assert_eq!(key.len(), 32);
    }
}
