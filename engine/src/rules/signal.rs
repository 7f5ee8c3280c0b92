//! Signals, in one place: the name rules a wait and a signal share, the
//! body `POST /v1/jobs/{id}/signals/{name}` takes and how it is checked,
//! an approval's payload ([`Decision`]), and the bounds a job's signals
//! live within. The API, the context, the typed client and the CLI all
//! read these; the statements that record and take signals are the
//! store's (`store::waits`).

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::InvalidInput;

/// Longest name of a timer or a signal, and longest signal id.
pub const MAX_WAIT_NAME: usize = 200;

/// Largest signal payload, serialised.
pub const MAX_SIGNAL_PAYLOAD: usize = 64 * 1024;

/// Most untaken signals one job holds; past it a signal is refused.
pub const MAX_UNTAKEN_SIGNALS: i64 = 100;

/// Most bytes of untaken signals' payloads one job holds (as JSON text).
pub const MAX_UNTAKEN_SIGNAL_BYTES: i64 = 1024 * 1024;

/// Signals a job's view shows: the latest.
pub const SIGNALS_SHOWN: i64 = 100;

/// The name every approval wait's signal starts with
/// (`approval:{tool_call_id}`).
pub const APPROVAL_PREFIX: &str = "approval:";

/// Whether `name` may name a timer or a signal (or be a signal's id):
/// 1–200 characters of `A-Z a-z 0-9 _ . : -` (it becomes part of a key
/// and of a URL path).
pub fn valid_wait_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_WAIT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// A person's decision on a tool call: the payload of an `approval:…` signal.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// Whether the tool may run.
    pub approved: bool,
    /// Why, for the model and the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A signal as sent, checked: `{"id", "payload", "until"?}` for `name`.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalBody {
    /// The sender's id for it: the same id again is the same signal.
    pub id: String,
    /// What it carries.
    pub payload: Value,
    /// The wait it is for (that wait's `waiting.until`), when given.
    pub until: Option<DateTime<Utc>>,
}

impl SignalBody {
    /// A signal `id` carrying `payload`, for whichever wait of its name
    /// comes first.
    pub fn new(id: impl Into<String>, payload: Value) -> Self {
        SignalBody {
            id: id.into(),
            payload,
            until: None,
        }
    }

    /// Checks a signal's body for `name`, naming the field at fault: the
    /// name and the id (1–200 characters of `A-Z a-z 0-9 _ . : -`), a
    /// payload (any JSON, at most 64 KiB, no NUL character; an approval's
    /// is a [`Decision`]), an `until` in RFC 3339, and no other field.
    pub fn parse(name: &str, body: Value) -> Result<SignalBody, InvalidInput> {
        const NAME_RULE: &str = "must be 1-200 characters of A-Z a-z 0-9 _ . : -";
        if !valid_wait_name(name) {
            return Err(InvalidInput::new("name", NAME_RULE));
        }
        let Value::Object(mut body) = body else {
            return Err(InvalidInput::new(
                "body",
                "must be a JSON object {\"id\", \"payload\"}",
            ));
        };
        let id = match body.remove("id") {
            Some(Value::String(s)) if valid_wait_name(&s) => s,
            Some(_) => return Err(InvalidInput::new("id", NAME_RULE)),
            None => return Err(InvalidInput::new("id", "is required")),
        };
        let Some(payload) = body.remove("payload") else {
            return Err(InvalidInput::new("payload", "is required (any JSON value)"));
        };
        let until = match body.remove("until") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => return Err(InvalidInput::new("until", UNTIL_RULE)),
        };
        if let Some(extra) = body.keys().next() {
            return Err(InvalidInput::new(extra.clone(), "unknown field"));
        }
        Self::checked(name, id, payload, until.as_deref())
    }

    /// Checks a signal of `name` whose fields are parsed already: the id,
    /// the payload's size, characters and (for an approval) shape, and
    /// `until` in RFC 3339.
    pub fn checked(
        name: &str,
        id: String,
        payload: Value,
        until: Option<&str>,
    ) -> Result<SignalBody, InvalidInput> {
        const NAME_RULE: &str = "must be 1-200 characters of A-Z a-z 0-9 _ . : -";
        if !valid_wait_name(name) {
            return Err(InvalidInput::new("name", NAME_RULE));
        }
        if !valid_wait_name(&id) {
            return Err(InvalidInput::new("id", NAME_RULE));
        }
        let until = match until {
            None => None,
            Some(s) => Some(
                DateTime::parse_from_rfc3339(s)
                    .map_err(|_| InvalidInput::new("until", UNTIL_RULE))?
                    .with_timezone(&Utc),
            ),
        };
        let size = serde_json::to_vec(&payload).map_or(usize::MAX, |b| b.len());
        if size > MAX_SIGNAL_PAYLOAD {
            return Err(InvalidInput::new(
                "payload",
                format!("at most {MAX_SIGNAL_PAYLOAD} bytes"),
            ));
        }
        if crate::rules::payload::contains_nul(&payload) {
            return Err(InvalidInput::new("payload", "contains a NUL character"));
        }
        if name.starts_with(APPROVAL_PREFIX)
            && serde_json::from_value::<Decision>(payload.clone()).is_err()
        {
            return Err(InvalidInput::new(
                "payload",
                "an approval is {\"approved\": true|false, \"note\"?: \"…\"}",
            ));
        }
        Ok(SignalBody { id, payload, until })
    }
}

const UNTIL_RULE: &str = "must be an RFC 3339 time, as `waiting.until` shows it";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_signal_body_names_the_field_at_fault() {
        let ok = SignalBody::parse(
            "go",
            json!({ "id": "s-1", "payload": 7, "until": "2026-12-06T01:02:03.000456Z" }),
        )
        .unwrap();
        assert_eq!((ok.id.as_str(), &ok.payload), ("s-1", &json!(7)));
        assert!(ok.until.is_some());
        for (name, body, field) in [
            ("g o", json!({ "id": "s", "payload": 1 }), "name"),
            (
                &*"n".repeat(201),
                json!({ "id": "s", "payload": 1 }),
                "name",
            ),
            ("go", json!([1]), "body"),
            ("go", json!({ "payload": 1 }), "id"),
            ("go", json!({ "id": "s 1", "payload": 1 }), "id"),
            ("go", json!({ "id": 7, "payload": 1 }), "id"),
            ("go", json!({ "id": "s" }), "payload"),
            ("go", json!({ "id": "s", "payload": "a\u{0}b" }), "payload"),
            (
                "go",
                json!({ "id": "s", "payload": "x".repeat(65_536) }),
                "payload",
            ),
            (
                "go",
                json!({ "id": "s", "payload": 1, "until": "soon" }),
                "until",
            ),
            (
                "go",
                json!({ "id": "s", "payload": 1, "until": 5 }),
                "until",
            ),
            (
                "go",
                json!({ "id": "s", "payload": 1, "surprise": 1 }),
                "surprise",
            ),
            (
                "approval:c-1",
                json!({ "id": "s", "payload": { "ok": true } }),
                "payload",
            ),
        ] {
            let e = SignalBody::parse(name, body.clone()).expect_err(&body.to_string());
            assert_eq!(e.field, field, "{body}");
        }
        assert!(SignalBody::parse(
            "approval:c-1",
            json!({ "id": "s", "payload": { "approved": false, "note": "no" } })
        )
        .is_ok());
    }
}
