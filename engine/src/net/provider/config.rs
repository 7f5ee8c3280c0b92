//! Where and how to reach each provider: the configuration every wire
//! format reads its endpoint and key from.

use std::time::Duration;

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
    /// `ANTHROPIC_BASE_URL`: requests go to `{base}/v1/messages`.
    pub anthropic_base_url: String,
    /// `ANTHROPIC_API_KEY`, sent as `x-api-key`.
    pub anthropic_api_key: Option<String>,
}

impl std::fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("timeout", &self.timeout)
            .field("h2c", &self.h2c)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("anthropic_base_url", &self.anthropic_base_url)
            .field(
                "anthropic_api_key",
                &self.anthropic_api_key.as_ref().map(|_| "[redacted]"),
            )
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
            anthropic_base_url: "https://api.anthropic.com".to_owned(),
            anthropic_api_key: None,
        }
    }
}
