//! The model providers, one seam per wire format: a workflow always speaks
//! OpenAI's chat-completions format, and a request's `"provider"` field
//! picks the [`WireFormat`] ([`format`]) that sends it and reads the answer
//! back into a chat completion — [`openai`] (chat completions, the default)
//! or [`anthropic`] (the Messages API) — so journals, keys and workflows
//! are the same for every provider. This module is the transport they
//! share: one POST with the job's `Idempotency-Key` and `traceparent`, its
//! timeout and size cap, and a streamed answer read event by event
//! ([`sse`]).

pub mod anthropic;
pub mod config;
pub mod format;
pub mod openai;
pub mod sse;

use anthropic::AnthropicMessages;
pub use anthropic::{ANTHROPIC_DEFAULT_MAX_TOKENS, ANTHROPIC_VERSION};
pub use config::{ProviderConfig, DEFAULT_MAX_RESPONSE_BYTES};
pub use format::WireFormat;
use openai::OpenAiChat;

use std::time::Duration;

use serde_json::Value;

use crate::faults::{FailPoint, Faults};
use crate::net::outbound::{post as post_to, Post, PostError, Seam};
use crate::rules::failure::Failure;

/// Every wire format onceflow speaks; the first is a request's default.
pub static FORMATS: &[&dyn WireFormat] = &[&OpenAiChat, &AnthropicMessages];

/// The format `request` names in its `"provider"` field (the first of
/// [`FORMATS`] when it names none); an unknown name is an error listing
/// the known ones.
pub fn format_of(request: &Value) -> Result<&'static dyn WireFormat, String> {
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

/// Where a model request goes (see `Provider::target`).
struct Target {
    format: &'static dyn WireFormat,
    url: String,
    /// The key, the trace and the provider's own headers.
    headers: Vec<(&'static str, String)>,
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

/// The seam a model call passes once the provider has answered, before
/// the answer is read: [`FailPoint::ModelAfterSend`].
fn answered<'a>(faults: &'a Faults, job_id: &'a str) -> Seam<'a> {
    Seam {
        faults,
        job_id,
        point: FailPoint::ModelAfterSend,
    }
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

    /// Where `request` goes, by its `"provider"`: its format, the URL, and
    /// the headers every send carries (the key, the trace, the provider's
    /// own). An unknown provider is a permanent `400`.
    fn target(&self, request: &Value, key: &str, traceparent: &str) -> Result<Target, PostError> {
        let format = format_of(request).map_err(|body| {
            PostError::Failed(Failure::Status {
                status: 400,
                retry_after: None,
                body,
            })
        })?;
        let (url, own) = format.endpoint(&self.config);
        let mut headers = vec![
            ("idempotency-key", key.to_owned()),
            ("traceparent", traceparent.to_owned()),
        ];
        headers.extend(own);
        Ok(Target {
            format,
            url,
            headers,
        })
    }

    /// The POST of `body` to the provider's `url`: its timeout, its cap on
    /// the answer (error bodies kept, redacted), no SSRF guard (the
    /// provider's URL is the operator's).
    fn post<'a>(
        &self,
        url: &'a str,
        headers: Vec<(&'static str, String)>,
        body: &Value,
    ) -> Post<'a> {
        Post {
            url,
            headers,
            body: serde_json::to_vec(body).expect("a JSON value serialises"),
            timeout: self.config.timeout,
            read: crate::net::outbound::Read::BodyAndErrors {
                limit: self.config.max_response_bytes,
            },
            guard: None,
        }
    }

    /// POSTs `request` (an OpenAI chat-completions request) with
    /// `Idempotency-Key: key` and the job's `traceparent`, in the wire
    /// format its `"provider"` names. The answer is a chat completion
    /// whatever the format.
    pub async fn chat(
        &self,
        key: &str,
        request: &Value,
        traceparent: &str,
        faults: &Faults,
        job_id: &str,
    ) -> Result<(Value, Usage, u16), PostError> {
        let Target {
            format,
            url,
            headers,
        } = self.target(request, key, traceparent)?;
        let body = format.body(request, false);
        let post = self.post(&url, headers, &body);
        let seam = answered(faults, job_id);
        let (status, bytes) = post_to(&self.client, post, Some(seam)).await?;
        let response: Value = serde_json::from_slice(&bytes).map_err(|e| {
            PostError::Failed(Failure::BadResponse(format!(
                "the response is not JSON: {e}"
            )))
        })?;
        let response = format
            .answer(response)
            .map_err(|e| PostError::Failed(Failure::BadResponse(e)))?;
        if response.pointer("/choices/0/message").is_none() {
            return Err(PostError::Failed(Failure::BadResponse(
                "the response has no choices[0].message".to_owned(),
            )));
        }
        let usage = Usage::of(&response);
        Ok((response, usage, status))
    }
}

impl Provider {
    /// As [`chat`](Self::chat) for a request with `"stream": true`: asks
    /// for server-sent events (in the request's format) and
    /// hands each piece of the answer's text to `on_text` as it arrives.
    /// The answer is the whole chat completion, assembled, in the same shape
    /// for both. A stream that breaks or ends before its end (`data:
    /// [DONE]`, or `message_stop`) is an ambiguous failure: the provider may
    /// have done the work, and the next attempt asks again under the same
    /// key.
    pub async fn chat_stream(
        &self,
        key: &str,
        request: &Value,
        traceparent: &str,
        faults: &Faults,
        job_id: &str,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(Value, Usage, u16), PostError> {
        let Target {
            format,
            url,
            mut headers,
        } = self.target(request, key, traceparent)?;
        headers.push(("accept", "text/event-stream".to_owned()));
        let body = format.body(request, true);
        let post = self.post(&url, headers, &body);
        let seam = answered(faults, job_id);
        let (status, response) = crate::net::outbound::open(&self.client, post, Some(seam)).await?;
        let answer = self.read_stream(response, format, on_text).await?;
        let response = answer.completion(request);
        let usage = Usage::of(&response);
        Ok((response, usage, status))
    }
    /// Reads an answer's events as they arrive, handing each piece of text
    /// to `on_text`, up to its end; a stream that stalls, breaks, grows
    /// past the response limit or ends before its end is a failure.
    async fn read_stream(
        &self,
        mut response: reqwest::Response,
        format: &'static dyn WireFormat,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<format::Answer, PostError> {
        let mut events = sse::Events::default();
        let mut answer = format::Answer::new(format);
        let broken = |what: String| PostError::Failed(Failure::Ambiguous(what));
        loop {
            // The model timeout bounds each gap between chunks.
            let read = tokio::time::timeout(self.config.timeout, response.chunk()).await;
            let chunk = match read {
                Ok(Ok(Some(chunk))) => chunk,
                Ok(Ok(None)) => break,
                Err(_) => {
                    return Err(broken(format!(
                        "the stream stalled for {} ms after {} chunks",
                        self.config.timeout.as_millis(),
                        answer.chunks
                    )))
                }
                Ok(Err(e)) => {
                    return Err(broken(format!(
                        "the stream broke after {} chunks: {e}",
                        answer.chunks
                    )))
                }
            };
            for data in events.push(&chunk) {
                if let Some(text) = answer.take(&data).map_err(|e| {
                    PostError::Failed(Failure::BadResponse(format!("a stream event: {e}")))
                })? {
                    on_text(&text);
                }
            }
            // Every byte counts against the limit (an event that never
            // ends, a body that is not a stream), and the text taken, which
            // is rebuilt from the events into the whole answer.
            let limit = self.config.max_response_bytes;
            if answer.size > limit
                || events.pending() > limit
                || events.received > limit.saturating_mul(16)
            {
                return Err(PostError::Failed(Failure::TooLarge {
                    limit: self.config.max_response_bytes,
                }));
            }
            if answer.done {
                break;
            }
        }
        if !answer.done {
            return Err(broken(format!(
                "the stream ended after {} chunks, before {}",
                answer.chunks,
                format.stream_end()
            )));
        }
        Ok(answer)
    }
}

impl Usage {
    /// The usage a chat completion reports (`usage.prompt_tokens`,
    /// `usage.completion_tokens`), each when present and in range.
    fn of(response: &Value) -> Self {
        let tokens = |name: &str| {
            response
                .pointer(&format!("/usage/{name}"))
                .and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        Usage {
            input_tokens: tokens("prompt_tokens"),
            output_tokens: tokens("completion_tokens"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_names_its_format_or_gets_the_first() {
        assert_eq!(
            format_of(&json!({ "model": "m" })).unwrap().name(),
            "openai"
        );
        assert_eq!(
            format_of(&json!({ "provider": "openai" })).unwrap().name(),
            "openai"
        );
        assert_eq!(
            format_of(&json!({ "provider": "anthropic" }))
                .unwrap()
                .name(),
            "anthropic"
        );
        assert_eq!(
            format_of(&json!({ "provider": "gemini" })).unwrap_err(),
            r#"unknown provider "gemini" (openai, anthropic)"#
        );
        assert!(format_of(&json!({ "provider": 1 })).is_err());
        let names: std::collections::BTreeSet<_> = FORMATS.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), FORMATS.len(), "each format's name is its own");
    }
}
