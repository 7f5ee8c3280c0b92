//! The model provider: OpenAI chat-completions wire format over reqwest.
//! Every request carries an `Idempotency-Key` derived from the job.

use std::time::Duration;

use serde_json::Value;

use crate::faults::{FailPoint, Faults};
use crate::outbound::{post, Failure, Post, PostError, Seam};

/// Where and how to reach the model. `Debug` never shows the API key.
#[derive(Clone)]
pub struct ProviderConfig {
    /// `OPENAI_BASE_URL`, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// `OPENAI_API_KEY`; sent as a bearer token when set.
    pub api_key: Option<String>,
    /// Timeout of one request.
    pub timeout: Duration,
    /// Speak HTTP/2 without TLS (prior knowledge, "h2c") to a plain-`http`
    /// provider or gateway that supports it: every in-flight call shares one
    /// connection. HTTPS providers negotiate HTTP/2 by ALPN without this.
    pub h2c: bool,
    /// Largest answer read (default 8 MiB); more is `response_too_large`.
    pub max_response_bytes: usize,
}

impl std::fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("timeout", &self.timeout)
            .field("h2c", &self.h2c)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

/// The default cap on a provider's answer.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 << 20;

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            base_url: "https://api.openai.com/v1".to_owned(),
            api_key: None,
            timeout: Duration::from_secs(120),
            h2c: false,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        }
    }
}

/// Token usage reported by the provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens (`usage.prompt_tokens`), when reported.
    pub input_tokens: Option<i32>,
    /// Completion tokens (`usage.completion_tokens`), when reported.
    pub output_tokens: Option<i32>,
}

/// A chat-completions client.
#[derive(Debug, Clone)]
pub struct Provider {
    client: reqwest::Client,
    config: ProviderConfig,
}

impl Provider {
    /// A client for the provider `config` describes, sending through `client`.
    pub fn new(client: reqwest::Client, config: ProviderConfig) -> Self {
        Provider { client, config }
    }

    /// How long one model call may take.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// POSTs `request` to `/chat/completions` with `Idempotency-Key: key` and
    /// the job's `traceparent`.
    pub async fn chat(
        &self,
        key: &str,
        request: &Value,
        traceparent: &str,
        faults: &Faults,
        job_id: &str,
    ) -> Result<(Value, Usage, u16), PostError> {
        let url = format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        );
        let mut headers = vec![
            ("idempotency-key", key.to_owned()),
            ("traceparent", traceparent.to_owned()),
        ];
        if let Some(api_key) = &self.config.api_key {
            headers.push(("authorization", format!("Bearer {api_key}")));
        }
        let body = serde_json::to_vec(request).expect("a JSON value serialises");
        let request = Post {
            url: &url,
            headers,
            body,
            timeout: self.config.timeout,
            read: crate::outbound::Read::BodyAndErrors {
                limit: self.config.max_response_bytes,
            },
            guard: None,
        };
        let seam = Seam {
            faults,
            job_id,
            point: FailPoint::ModelAfterSend,
        };
        let (status, bytes) = post(&self.client, request, Some(seam)).await?;
        let response: Value = serde_json::from_slice(&bytes).map_err(|e| {
            PostError::Failed(Failure::BadResponse(format!(
                "the response is not JSON: {e}"
            )))
        })?;
        if response.pointer("/choices/0/message").is_none() {
            return Err(PostError::Failed(Failure::BadResponse(
                "the response has no choices[0].message".to_owned(),
            )));
        }
        let tokens = |name: &str| {
            response
                .pointer(&format!("/usage/{name}"))
                .and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        let usage = Usage {
            input_tokens: tokens("prompt_tokens"),
            output_tokens: tokens("completion_tokens"),
        };
        Ok((response, usage, status))
    }
}
