//! The seam between onceflow and a provider's wire format. A workflow
//! always speaks OpenAI's chat-completions format; a [`WireFormat`] says
//! what is sent for such a request (URL, auth headers, body), and reads the
//! provider's answer — whole or as server-sent events — back into a chat
//! completion, so journals, keys, usage and workflows are the same for
//! every provider. A request names its format in onceflow's own
//! `"provider"` field (never sent); [`FORMATS`] lists them, the first being
//! the default.
//!
//! Adding a format is one new file beside this one implementing the trait,
//! and one line in [`FORMATS`] (plus its base URL and key in
//! [`ProviderConfig`] when it has its own).

use serde_json::Value;

use super::anthropic::AnthropicMessages;
use super::openai::OpenAiChat;
use super::sse::Answer;
use super::ProviderConfig;

/// One provider's wire format.
pub trait WireFormat: Send + Sync + std::fmt::Debug {
    /// The name a request gives in its `"provider"` field.
    fn name(&self) -> &'static str;

    /// Where a request is POSTed, and the provider's own headers (its auth,
    /// its version); the idempotency key and the trace are added by the
    /// caller.
    fn endpoint(&self, config: &ProviderConfig) -> (String, Vec<(&'static str, String)>);

    /// The body sent for `request`, an OpenAI chat-completions request
    /// which may carry onceflow's `"provider"` field; `stream` asks for
    /// server-sent events.
    fn body(&self, request: &Value, stream: bool) -> Value;

    /// The chat completion a whole answer amounts to.
    fn answer(&self, response: Value) -> Result<Value, String>;

    /// Takes one streamed event's data into `answer`; returns the text it
    /// adds, if any. An event that reports an error fails the stream.
    fn event(&self, answer: &mut Answer, data: &str) -> Result<Option<String>, String>;

    /// What ends a stream, as a stream that ended early names it.
    fn stream_end(&self) -> &'static str;

    /// Makes the completion a stream amounted to read as the whole answer
    /// would have (the default leaves it as assembled).
    fn finish(&self, completion: &mut Value) {
        let _ = completion;
    }
}

/// Every wire format onceflow speaks; the first is a request's default.
pub static FORMATS: &[&dyn WireFormat] = &[&OpenAiChat, &AnthropicMessages];

/// The format `request` names in its `"provider"` field (the first of
/// [`FORMATS`] when it names none); an unknown name is an error listing
/// the known ones.
pub fn of(request: &Value) -> Result<&'static dyn WireFormat, String> {
    let Some(name) = request.get("provider") else {
        return Ok(FORMATS[0]);
    };
    let known = || {
        FORMATS
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(name) = name.as_str() else {
        return Err(format!("provider must be a string ({})", known()));
    };
    FORMATS
        .iter()
        .find(|f| f.name() == name)
        .copied()
        .ok_or_else(|| format!("unknown provider {name:?} ({})", known()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_names_its_format_or_gets_the_first() {
        assert_eq!(of(&json!({ "model": "m" })).unwrap().name(), "openai");
        assert_eq!(
            of(&json!({ "provider": "openai" })).unwrap().name(),
            "openai"
        );
        assert_eq!(
            of(&json!({ "provider": "anthropic" })).unwrap().name(),
            "anthropic"
        );
        assert_eq!(
            of(&json!({ "provider": "gemini" })).unwrap_err(),
            r#"unknown provider "gemini" (openai, anthropic)"#
        );
        assert!(of(&json!({ "provider": 1 })).is_err());
        let names: std::collections::BTreeSet<_> = FORMATS.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), FORMATS.len(), "each format's name is its own");
    }
}
