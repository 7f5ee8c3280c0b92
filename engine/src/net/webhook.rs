//! The completion webhook: body, headers and the Standard Webhooks signature.
//!
//! Headers on every attempt of one event are the same key:
//! `Idempotency-Key` and `webhook-id` are both `job:{id}:completed`;
//! `webhook-timestamp` is the time of this attempt; `webhook-signature` is
//! `v1,` + base64(HMAC-SHA256(secret, "{id}.{timestamp}.{body}")) when a
//! `whsec_…` secret is configured.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

use crate::faults::{FailPoint, Faults};
use crate::net::outbound::{post, Post, PostError, Seam};

/// The Standard Webhooks signing secrets (`whsec_` + base64 key each; several,
/// space-separated, while rotating): every delivery carries one `v1,`
/// signature per secret, so a consumer that knows either verifies it.
#[derive(Clone)]
pub struct WebhookSecret(Vec<Vec<u8>>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WebhookSecret({} secrets, redacted)", self.0.len())
    }
}

/// Shortest decoded secret accepted (Standard Webhooks keys are 24–64 bytes).
pub const MIN_SECRET_BYTES: usize = 24;

/// A secret is not `whsec_` followed by base64 of at least 24 bytes.
#[derive(Debug, thiserror::Error)]
#[error("ONCEFLOW_WEBHOOK_SECRET must be one or more space-separated `whsec_` + base64 secrets of at least 24 bytes each: {0}")]
pub struct BadSecret(String);

impl std::str::FromStr for WebhookSecret {
    type Err = BadSecret;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut keys = Vec::new();
        for (i, part) in s.split_whitespace().enumerate() {
            let n = i + 1;
            let b64 = part
                .strip_prefix("whsec_")
                .ok_or_else(|| BadSecret(format!("secret {n} lacks the whsec_ prefix")))?;
            let key = B64
                .decode(b64)
                .map_err(|e| BadSecret(format!("secret {n} is not base64 ({e})")))?;
            if key.len() < MIN_SECRET_BYTES {
                return Err(BadSecret(format!(
                    "secret {n} is {} bytes; at least {MIN_SECRET_BYTES} are needed",
                    key.len()
                )));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(BadSecret("no secret given".into()));
        }
        Ok(WebhookSecret(keys))
    }
}

impl WebhookSecret {
    /// The `webhook-signature` value: `v1,<base64>` per secret, space-separated,
    /// each over `id.timestamp.body`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        self.0
            .iter()
            .map(|key| {
                let mut mac =
                    Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
                mac.update(id.as_bytes());
                mac.update(b".");
                mac.update(timestamp.to_string().as_bytes());
                mac.update(b".");
                mac.update(body);
                format!("v1,{}", B64.encode(mac.finalize().into_bytes()))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// How many secrets sign each delivery.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true: parsing refuses an empty list.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// How webhooks leave this node.
#[derive(Debug, Clone, Copy)]
pub struct Sender<'a> {
    /// The guarded client: no redirects, names resolved through the guard.
    pub client: &'a reqwest::Client,
    /// The SSRF guard (literal addresses are checked before the send).
    pub guard: &'a crate::net::guard::UrlGuard,
    /// Signs each send (`webhook-signature`); `None` sends unsigned.
    pub secret: Option<&'a WebhookSecret>,
    /// How long one send may take.
    pub timeout: Duration,
}

/// Sends one attempt of the event `key` with `body` to `url`; `Ok(status)` on 2xx.
pub async fn send(
    sender: Sender<'_>,
    url: &str,
    key: &str,
    body: &Value,
    traceparent: &str,
    faults: &Faults,
    job_id: &str,
) -> Result<u16, PostError> {
    let bytes = serde_json::to_vec(body).expect("a JSON value serialises");
    let timestamp = chrono::Utc::now().timestamp();
    let mut headers = vec![
        ("idempotency-key", key.to_owned()),
        ("webhook-id", key.to_owned()),
        ("webhook-timestamp", timestamp.to_string()),
        ("traceparent", traceparent.to_owned()),
    ];
    if let Some(secret) = sender.secret {
        headers.push(("webhook-signature", secret.sign(key, timestamp, &bytes)));
    }
    let request = Post {
        url,
        headers,
        body: bytes,
        timeout: sender.timeout,
        read: crate::net::outbound::Read::Status,
        guard: Some(sender.guard),
    };
    let seam = Seam {
        faults,
        job_id,
        point: FailPoint::WebhookAfterSend,
    };
    let (status, _) = post(sender.client, request, Some(seam)).await?;
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_like_the_standard_webhooks_reference() {
        // The test vector published with the Standard Webhooks specification.
        let secret: WebhookSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".parse().unwrap();
        let sig = secret.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn rejects_malformed_and_short_secrets() {
        assert!("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
            .parse::<WebhookSecret>()
            .is_err());
        assert!("whsec_!!!".parse::<WebhookSecret>().is_err());
        // 16 bytes decoded: too short.
        let short = format!("whsec_{}", B64.encode([7u8; 16]));
        let e = short.parse::<WebhookSecret>().unwrap_err().to_string();
        assert!(e.contains("16 bytes"), "{e}");
        assert!("".parse::<WebhookSecret>().is_err());
        assert!(!format!(
            "{:?}",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
                .parse::<WebhookSecret>()
                .unwrap()
        )
        .contains("MfKQ"));
    }

    #[test]
    fn several_secrets_sign_once_each_for_rotation() {
        let old = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let new = format!("whsec_{}", B64.encode([42u8; 32]));
        let both: WebhookSecret = format!("{old} {new}").parse().unwrap();
        assert_eq!(both.len(), 2);
        let sig = both.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        let parts: Vec<&str> = sig.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let only_new: WebhookSecret = new.parse().unwrap();
        assert_eq!(
            parts[1],
            only_new.sign(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1614265330,
                br#"{"test": 2432232314}"#
            )
        );
    }
}
