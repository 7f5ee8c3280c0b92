//! The model providers: OpenAI chat completions, and the Anthropic Messages
//! API behind the same interface. A workflow always speaks OpenAI's format;
//! a request carrying `"provider": "anthropic"` is translated to a Messages
//! request (system prompt, `tool_use`/`tool_result` blocks, tools) and the
//! answer back to a chat completion (text, tool calls, finish reason, usage),
//! so journals, keys and workflows are the same for both. Every request
//! carries an `Idempotency-Key` derived from the job; Anthropic ignores it
//! (a retry after a lost answer may be billed again; the journal still keeps
//! one result and one delivery).

use std::time::Duration;

use serde_json::Value;

use crate::faults::{FailPoint, Faults};
use crate::net::outbound::{post, Post, PostError, Seam};
use crate::rules::failure::Failure;

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

/// Where a model request goes (see `Provider::target`).
struct Target {
    /// To Anthropic's Messages API (else OpenAI's chat completions).
    anthropic: bool,
    url: String,
    /// The key, the trace and the provider's auth.
    headers: Vec<(&'static str, String)>,
}

/// The `anthropic-version` header onceflow speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `max_tokens` sent to Anthropic (which requires it) when a job sets none.
pub const ANTHROPIC_DEFAULT_MAX_TOKENS: u64 = 1024;

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

    /// Where `request` goes, by its `"provider"`: whether it is Anthropic,
    /// the URL (`/chat/completions`, or Anthropic's `/v1/messages`), and the
    /// headers every send carries (the key, the trace, the provider's auth).
    /// An unknown provider is a permanent `400`.
    fn target(&self, request: &Value, key: &str, traceparent: &str) -> Result<Target, PostError> {
        let anthropic = match request.get("provider").and_then(Value::as_str) {
            None | Some("openai") => false,
            Some("anthropic") => true,
            Some(other) => {
                return Err(PostError::Failed(Failure::Status {
                    status: 400,
                    retry_after: None,
                    body: format!("unknown provider {other:?} (openai, anthropic)"),
                }))
            }
        };
        let mut headers = vec![
            ("idempotency-key", key.to_owned()),
            ("traceparent", traceparent.to_owned()),
        ];
        let url = if anthropic {
            if let Some(api_key) = &self.config.anthropic_api_key {
                headers.push(("x-api-key", api_key.clone()));
            }
            headers.push(("anthropic-version", ANTHROPIC_VERSION.to_owned()));
            format!(
                "{}/v1/messages",
                self.config.anthropic_base_url.trim_end_matches('/')
            )
        } else {
            if let Some(api_key) = &self.config.api_key {
                headers.push(("authorization", format!("Bearer {api_key}")));
            }
            format!(
                "{}/chat/completions",
                self.config.base_url.trim_end_matches('/')
            )
        };
        Ok(Target {
            anthropic,
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
    /// `Idempotency-Key: key` and the job's `traceparent`: to
    /// `/chat/completions`, or translated to Anthropic's `/v1/messages` when
    /// it carries `"provider": "anthropic"`. The answer is a chat completion
    /// either way.
    pub async fn chat(
        &self,
        key: &str,
        request: &Value,
        traceparent: &str,
        faults: &Faults,
        job_id: &str,
    ) -> Result<(Value, Usage, u16), PostError> {
        let Target {
            anthropic,
            url,
            headers,
        } = self.target(request, key, traceparent)?;
        let body = if anthropic {
            std::borrow::Cow::Owned(anthropic::request(request))
        } else {
            // `provider` is onceflow's own field: it is not sent.
            if request.get("provider").is_some() {
                let mut request = request.clone();
                if let Some(o) = request.as_object_mut() {
                    o.remove("provider");
                }
                std::borrow::Cow::Owned(request)
            } else {
                std::borrow::Cow::Borrowed(request)
            }
        };
        let request = self.post(&url, headers, &body);
        let seam = answered(faults, job_id);
        let (status, bytes) = post(&self.client, request, Some(seam)).await?;
        let response: Value = serde_json::from_slice(&bytes).map_err(|e| {
            PostError::Failed(Failure::BadResponse(format!(
                "the response is not JSON: {e}"
            )))
        })?;
        let response = if anthropic {
            anthropic::response(&response)
                .map_err(|e| PostError::Failed(Failure::BadResponse(e)))?
        } else {
            response
        };
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
    /// for server-sent events (OpenAI's chunks with
    /// `stream_options.include_usage`, or Anthropic's Messages events) and
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
            anthropic,
            url,
            mut headers,
        } = self.target(request, key, traceparent)?;
        headers.push(("accept", "text/event-stream".to_owned()));
        let body = stream_body(anthropic, request);
        let post = self.post(&url, headers, &body);
        let seam = answered(faults, job_id);
        let (status, response) = crate::net::outbound::open(&self.client, post, Some(seam)).await?;
        let answer = self.read_stream(response, anthropic, on_text).await?;
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
        anthropic: bool,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<sse::Answer, PostError> {
        let mut events = sse::Events::default();
        let mut answer = if anthropic {
            sse::Answer::anthropic()
        } else {
            sse::Answer::default()
        };
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
                if anthropic {
                    "message_stop"
                } else {
                    "data: [DONE]"
                }
            )));
        }
        Ok(answer)
    }
}

/// The body of a streamed request: Anthropic's Messages request, or the
/// chat completion without `provider`, asking for usage in the last chunk.
fn stream_body(anthropic: bool, request: &Value) -> Value {
    let mut body = if anthropic {
        anthropic::request(request)
    } else {
        request.clone()
    };
    if let Some(o) = body.as_object_mut() {
        o.insert("stream".into(), Value::Bool(true));
        if !anthropic {
            o.remove("provider");
            o.insert(
                "stream_options".into(),
                serde_json::json!({ "include_usage": true }),
            );
        }
    }
    body
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

/// Server-sent events of streamed answers: OpenAI's chat-completion chunks
/// and Anthropic's Messages events, each assembled into one chat
/// completion.
pub mod sse {
    use serde_json::{json, Value};

    /// Most tool calls taken from one streamed answer.
    pub const MAX_TOOL_CALLS: usize = 128;

    /// Splits a byte stream into the `data:` payloads of its events.
    #[derive(Debug, Default)]
    pub struct Events {
        buffer: Vec<u8>,
        /// Bytes taken in all.
        pub received: usize,
    }

    impl Events {
        /// Bytes of an event not complete yet.
        pub fn pending(&self) -> usize {
            self.buffer.len()
        }

        /// Adds `bytes`; returns the data of every event now complete.
        pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
            self.received += bytes.len();
            self.buffer.extend_from_slice(bytes);
            let mut out = Vec::new();
            loop {
                let text = &self.buffer;
                // An event ends at a blank line (LF LF, or CR LF CR LF).
                let end = text
                    .windows(2)
                    .position(|w| w == b"\n\n")
                    .map(|i| (i, 2))
                    .into_iter()
                    .chain(
                        text.windows(4)
                            .position(|w| w == b"\r\n\r\n")
                            .map(|i| (i, 4)),
                    )
                    .min_by_key(|(i, _)| *i);
                let Some((at, len)) = end else { break };
                let event = String::from_utf8_lossy(&self.buffer[..at]).into_owned();
                self.buffer.drain(..at + len);
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data.is_empty() {
                    out.push(data.join("\n"));
                }
            }
            out
        }
    }

    /// The answer, assembled from its chunks.
    #[derive(Debug, Default)]
    pub struct Answer {
        /// The text so far.
        pub content: String,
        /// Chunks received.
        pub chunks: usize,
        /// `data: [DONE]` arrived.
        pub done: bool,
        /// Bytes of text taken so far (the answer's and tool calls').
        pub size: usize,
        id: Option<Value>,
        model: Option<Value>,
        finish_reason: Option<Value>,
        usage: Option<Value>,
        /// Tool calls, by their `index`: each arrives as a first delta with
        /// its id, type and name, then its `arguments` in pieces.
        tool_calls: std::collections::BTreeMap<u64, Value>,
        /// The events are Anthropic's (see [`Answer::anthropic`]).
        anthropic: bool,
    }

    impl Answer {
        /// An answer read from Anthropic's Messages events: `message_start`
        /// (id, model, input tokens), `content_block_start` (a text block,
        /// or a `tool_use` block's id and name), `content_block_delta`
        /// (`text_delta`, or a tool's `input_json_delta`), `message_delta`
        /// (stop reason, output tokens), `message_stop` (the end), `error`.
        /// Others (`ping`, `content_block_stop`) carry nothing to keep.
        pub fn anthropic() -> Self {
            Answer {
                anthropic: true,
                ..Answer::default()
            }
        }

        /// Takes one event's data; returns the text it adds, if any.
        pub fn take(&mut self, data: &str) -> Result<Option<String>, String> {
            if self.anthropic {
                return self.take_anthropic(data);
            }
            if data.trim() == "[DONE]" {
                self.done = true;
                return Ok(None);
            }
            let event = self.event(data)?;
            for (field, slot) in [("id", &mut self.id), ("model", &mut self.model)] {
                if slot.is_none() {
                    *slot = event.get(field).cloned();
                }
            }
            if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
                self.usage = Some(usage.clone());
            }
            let choice = &event["choices"][0];
            if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
                self.finish_reason = Some(reason.clone());
            }
            for delta in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                self.tool_call(delta)?;
            }
            match choice["delta"]["content"].as_str() {
                Some(text) if !text.is_empty() => Ok(Some(self.text(text))),
                _ => Ok(None),
            }
        }

        /// One event of the stream, counted; an error the provider reports
        /// in the stream (credentials redacted) fails it.
        fn event(&mut self, data: &str) -> Result<Value, String> {
            let event: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if let Some(error) = event.get("error") {
                return Err(format!(
                    "the provider reported an error mid-stream: {}",
                    crate::net::outbound::redact(&error.to_string())
                ));
            }
            self.chunks += 1;
            Ok(event)
        }

        fn take_anthropic(&mut self, data: &str) -> Result<Option<String>, String> {
            let event = self.event(data)?;
            match event["type"].as_str() {
                Some("message_start") => {
                    let message = &event["message"];
                    self.id = message.get("id").cloned();
                    self.model = message.get("model").cloned();
                    self.usage = Some(json!({
                        "prompt_tokens": message["usage"]["input_tokens"],
                        "completion_tokens": message["usage"]["output_tokens"],
                    }));
                }
                Some("content_block_start") => {
                    let block = &event["content_block"];
                    if block["type"] == "tool_use" {
                        // The same head an OpenAI stream's first piece has;
                        // an input given whole here (not streamed as
                        // pieces) is the call's arguments.
                        let whole = block["input"]
                            .as_object()
                            .filter(|o| !o.is_empty())
                            .map(|o| Value::Object(o.clone()).to_string());
                        self.tool_call(&json!({
                            "index": event["index"],
                            "id": block["id"],
                            "type": "function",
                            "function": { "name": block["name"], "arguments": whole },
                        }))?;
                    } else if let Some(text) = block["text"].as_str().filter(|t| !t.is_empty()) {
                        return Ok(Some(self.text(text)));
                    }
                }
                Some("content_block_delta") => {
                    let delta = &event["delta"];
                    match delta["type"].as_str() {
                        Some("text_delta") => {
                            if let Some(text) = delta["text"].as_str().filter(|t| !t.is_empty()) {
                                return Ok(Some(self.text(text)));
                            }
                        }
                        Some("input_json_delta") => {
                            let index = event["index"].as_u64();
                            if !index.is_some_and(|i| self.tool_calls.contains_key(&i)) {
                                return Err("an input_json_delta for no tool_use block".to_owned());
                            }
                            self.tool_call(&json!({
                                "index": index,
                                "function": { "arguments": delta["partial_json"] },
                            }))?;
                        }
                        _ => {}
                    }
                }
                Some("message_delta") => {
                    if let Some(reason) = event["delta"]["stop_reason"].as_str() {
                        self.finish_reason = Some(json!(super::anthropic::finish_reason(reason)));
                    }
                    // Counts here are cumulative: they replace message_start's.
                    if let Some(usage) = self.usage.as_mut() {
                        for (from, to) in [
                            ("input_tokens", "prompt_tokens"),
                            ("output_tokens", "completion_tokens"),
                        ] {
                            if let Some(n) = event["usage"].get(from).filter(|n| !n.is_null()) {
                                usage[to] = n.clone();
                            }
                        }
                    }
                }
                Some("message_stop") => self.done = true,
                _ => {}
            }
            Ok(None)
        }

        /// Adds a piece of the answer's text; returns it.
        fn text(&mut self, text: &str) -> String {
            self.size += text.len();
            self.content.push_str(text);
            text.to_owned()
        }

        /// Adds one `delta.tool_calls` entry to the call at its `index`.
        fn tool_call(&mut self, delta: &Value) -> Result<(), String> {
            let index = delta["index"]
                .as_u64()
                .ok_or("a tool-call delta without an index")?;
            if !self.tool_calls.contains_key(&index) && self.tool_calls.len() >= MAX_TOOL_CALLS {
                return Err(format!(
                    "more than {MAX_TOOL_CALLS} tool calls in one answer"
                ));
            }
            let call = self.tool_calls.entry(index).or_insert_with(|| {
                json!({ "id": "", "type": "function", "function": { "name": "", "arguments": "" } })
            });
            for field in ["id", "type"] {
                if let Some(v) = delta[field].as_str() {
                    call[field] = json!(v);
                }
            }
            if let Some(name) = delta["function"]["name"].as_str() {
                // Sent once, in the call's first piece (some servers repeat it).
                self.size += name.len();
                call["function"]["name"] = json!(name);
            }
            if let Some(piece) = delta["function"]["arguments"].as_str() {
                self.size += piece.len();
                if let Some(Value::String(so_far)) = call["function"].get_mut("arguments") {
                    so_far.push_str(piece);
                }
            }
            Ok(())
        }

        /// The chat completion the stream amounted to.
        pub fn completion(&self, request: &Value) -> Value {
            let mut message = json!({ "role": "assistant", "content": self.content });
            if !self.tool_calls.is_empty() {
                let mut calls: Vec<Value> = self.tool_calls.values().cloned().collect();
                if self.anthropic {
                    // As the whole answer reads (`"content": ""` and the
                    // tool's input as `arguments`): a tool_use block whose
                    // input streamed no pieces has the input `{}`.
                    for call in &mut calls {
                        if call["function"]["arguments"] == "" {
                            call["function"]["arguments"] = json!("{}");
                        }
                    }
                } else if self.content.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = Value::Array(calls);
            }
            let mut out = json!({
                "object": "chat.completion",
                "model": self.model.clone().unwrap_or_else(|| request["model"].clone()),
                "choices": [{
                    "index": 0,
                    "message": message,
                    "finish_reason": self.finish_reason.clone().unwrap_or(Value::Null),
                }],
            });
            if let Some(id) = &self.id {
                out["id"] = id.clone();
            }
            if self.anthropic {
                out["provider"] = json!("anthropic");
            }
            if let Some(usage) = &self.usage {
                out["usage"] = usage.clone();
            }
            out
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn events_split_at_blank_lines_across_reads() {
            let mut e = Events::default();
            assert!(e.push(b"data: {\"a\"").is_empty());
            assert_eq!(
                e.push(b":1}\n\ndata: [DONE]\r\n\r\n"),
                vec!["{\"a\":1}", "[DONE]"]
            );
            let mut a = Answer::default();
            let chunk = r#"{"id":"c1","model":"m","choices":[{"delta":{"content":"hé"}}]}"#;
            assert_eq!(a.take(chunk).unwrap().as_deref(), Some("hé"));
            let last = r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#;
            assert_eq!(a.take(last).unwrap(), None);
            a.take(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#)
                .unwrap();
            a.take("[DONE]").unwrap();
            assert!(a.done);
            let c = a.completion(&json!({ "model": "m" }));
            assert_eq!(c["choices"][0]["message"]["content"], "hé");
            assert_eq!(c["choices"][0]["finish_reason"], "stop");
            assert_eq!(c["usage"]["completion_tokens"], 1);
            assert!(a.take(r#"{"error":{"message":"overloaded"}}"#).is_err());
        }

        #[test]
        fn tool_calls_are_assembled_from_their_pieces() {
            let mut a = Answer::default();
            for data in [
                r#"{"choices":[{"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"http_post","arguments":""}}]}}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":1,"id":"call_2","type":"function","function":{"name":"lookup","arguments":"{}"}}]}}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"ticket\""}}]}}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":\"A\"}"}}]}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            ] {
                assert_eq!(a.take(data).unwrap(), None, "no text in {data}");
            }
            let c = a.completion(&json!({ "model": "m" }));
            let message = &c["choices"][0]["message"];
            assert_eq!(message["content"], Value::Null);
            assert_eq!(message["tool_calls"][0]["id"], "call_1");
            assert_eq!(message["tool_calls"][0]["function"]["name"], "http_post");
            assert_eq!(
                message["tool_calls"][0]["function"]["arguments"],
                r#"{"ticket":"A"}"#
            );
            assert_eq!(message["tool_calls"][1]["id"], "call_2");
            assert_eq!(c["choices"][0]["finish_reason"], "tool_calls");
            assert!(a
                .take(r#"{"choices":[{"delta":{"tool_calls":[{"id":"x"}]}}]}"#)
                .is_err());
        }

        #[test]
        fn anthropic_events_make_the_same_completion_as_the_whole_answer() {
            let mut a = Answer::anthropic();
            let mut texts = Vec::new();
            for data in [
                r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-x","stop_reason":null,"usage":{"input_tokens":25,"output_tokens":1}}}"#,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                r#"{"type":"ping"}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Let me "}}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"look."}}"#,
                r#"{"type":"content_block_stop","index":0}"#,
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"lookup","input":{}}}"#,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"order\":"}}"#,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"\"42\"}"}}"#,
                r#"{"type":"content_block_stop","index":1}"#,
                r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_2","name":"ping","input":{}}}"#,
                r#"{"type":"content_block_stop","index":2}"#,
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":30}}"#,
            ] {
                texts.extend(a.take(data).unwrap());
                assert!(!a.done, "not done before message_stop");
            }
            a.take(r#"{"type":"message_stop"}"#).unwrap();
            assert!(a.done);
            assert_eq!(texts, ["Let me ", "look."]);
            let streamed = a.completion(&json!({ "model": "m" }));
            let whole = crate::net::provider::anthropic::response(&json!({
                "id": "msg_1", "model": "claude-x", "stop_reason": "tool_use",
                "content": [
                    { "type": "text", "text": "Let me look." },
                    { "type": "tool_use", "id": "toolu_1", "name": "lookup", "input": { "order": "42" } },
                    { "type": "tool_use", "id": "toolu_2", "name": "ping", "input": {} }],
                "usage": { "input_tokens": 25, "output_tokens": 30 },
            }))
            .unwrap();
            assert_eq!(streamed, whole);
            assert!(Answer::anthropic()
                .take(
                    r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
                )
                .is_err());
            // An input given whole in the block's start is its arguments.
            let mut whole = Answer::anthropic();
            for data in [
                r#"{"type":"message_start","message":{"id":"m","model":"c","usage":{"input_tokens":3,"output_tokens":0}}}"#,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"t","name":"lookup","input":{"order": "7"}}}"#,
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"input_tokens":4,"output_tokens":9}}"#,
                r#"{"type":"message_stop"}"#,
            ] {
                whole.take(data).unwrap();
            }
            let c = whole.completion(&json!({ "model": "m" }));
            assert_eq!(
                c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
                r#"{"order":"7"}"#
            );
            assert_eq!(c["usage"]["prompt_tokens"], 4, "message_delta's counts win");
            assert_eq!(c["usage"]["completion_tokens"], 9);
            assert!(Answer::anthropic()
                .take(r#"{"type":"content_block_delta","index":5,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#)
                .is_err());
        }
    }
}

/// The translation between OpenAI's chat-completions format and Anthropic's
/// Messages API.
pub mod anthropic {
    use serde_json::{json, Map, Value};

    use super::ANTHROPIC_DEFAULT_MAX_TOKENS;

    /// A Messages request for an OpenAI chat-completions `request`: system
    /// messages become `system`; an assistant's `tool_calls` become
    /// `tool_use` blocks and `tool` messages `tool_result` blocks (merged
    /// into one user turn, as the API wants turns to alternate); function
    /// tools become tools with an `input_schema`.
    pub fn request(request: &Value) -> Value {
        let mut system = Vec::new();
        let mut messages: Vec<Value> = Vec::new();
        // OpenAI content is a string or an array of parts; the text parts
        // are what Anthropic can take as text.
        let text = |m: &Value| match &m["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        for m in request["messages"].as_array().into_iter().flatten() {
            match m["role"].as_str().unwrap_or_default() {
                "system" => system.push(text(m)),
                "assistant" => {
                    let mut blocks = Vec::new();
                    let content = text(m);
                    if !content.is_empty() {
                        blocks.push(json!({ "type": "text", "text": content }));
                    }
                    for call in m["tool_calls"].as_array().into_iter().flatten() {
                        let arguments = call["function"]["arguments"].as_str().unwrap_or("{}");
                        blocks.push(json!({
                            "type": "tool_use",
                            "id": call["id"],
                            "name": call["function"]["name"],
                            "input": serde_json::from_str::<Value>(arguments).unwrap_or(json!({})),
                        }));
                    }
                    // An empty turn is refused by the API: leave it out.
                    if !blocks.is_empty() {
                        messages.push(json!({ "role": "assistant", "content": blocks }));
                    }
                }
                "tool" => {
                    let block = json!({
                        "type": "tool_result",
                        "tool_use_id": m["tool_call_id"],
                        "content": text(m),
                    });
                    // Consecutive results share one user turn.
                    match messages.last_mut() {
                        Some(last)
                            if last["role"] == "user"
                                && last["content"][0]["type"] == "tool_result" =>
                        {
                            if let Some(blocks) = last["content"].as_array_mut() {
                                blocks.push(block);
                            }
                        }
                        _ => messages.push(json!({ "role": "user", "content": [block] })),
                    }
                }
                _ => messages.push(json!({ "role": "user", "content": text(m) })),
            }
        }
        let mut out = Map::new();
        out.insert("model".into(), request["model"].clone());
        out.insert(
            "max_tokens".into(),
            request
                .get("max_tokens")
                .cloned()
                .unwrap_or(json!(ANTHROPIC_DEFAULT_MAX_TOKENS)),
        );
        if !system.is_empty() {
            out.insert("system".into(), json!(system.join("\n\n")));
        }
        out.insert("messages".into(), json!(messages));
        if let Some(t) = request.get("temperature") {
            out.insert("temperature".into(), t.clone());
        }
        if let Some(tools) = request["tools"].as_array() {
            let tools: Vec<Value> = tools
                .iter()
                .map(|t| {
                    let f = &t["function"];
                    let mut tool = json!({
                        "name": f["name"],
                        "input_schema": if f["parameters"].is_object() {
                            f["parameters"].clone()
                        } else {
                            json!({ "type": "object" })
                        },
                    });
                    if let Some(d) = f["description"].as_str() {
                        tool["description"] = json!(d);
                    }
                    tool
                })
                .collect();
            out.insert("tools".into(), json!(tools));
        }
        Value::Object(out)
    }

    /// The chat-completion `finish_reason` of a Messages `stop_reason`.
    pub fn finish_reason(stop_reason: &str) -> &'static str {
        match stop_reason {
            "max_tokens" => "length",
            "tool_use" => "tool_calls",
            "refusal" => "content_filter",
            _ => "stop",
        }
    }

    /// A chat completion for a Messages `response`: the text blocks joined,
    /// `tool_use` blocks as `tool_calls`, the stop reason as
    /// `finish_reason`, the usage as `prompt_tokens`/`completion_tokens`.
    pub fn response(response: &Value) -> Result<Value, String> {
        let blocks = response["content"]
            .as_array()
            .ok_or("the Anthropic response has no content array")?;
        let mut content = String::new();
        let mut tool_calls = Vec::new();
        for b in blocks {
            match b["type"].as_str() {
                Some("text") => content.push_str(b["text"].as_str().unwrap_or_default()),
                Some("tool_use") => tool_calls.push(json!({
                    "id": b["id"],
                    "type": "function",
                    "function": { "name": b["name"], "arguments": b["input"].to_string() },
                })),
                _ => {}
            }
        }
        let finish_reason = finish_reason(response["stop_reason"].as_str().unwrap_or_default());
        let mut message = json!({ "role": "assistant", "content": content });
        if !tool_calls.is_empty() {
            message["tool_calls"] = json!(tool_calls);
        }
        let input = response["usage"]["input_tokens"].clone();
        let output = response["usage"]["output_tokens"].clone();
        Ok(json!({
            "id": response["id"],
            "object": "chat.completion",
            "model": response["model"],
            "provider": "anthropic",
            "choices": [{ "index": 0, "message": message, "finish_reason": finish_reason }],
            "usage": { "prompt_tokens": input, "completion_tokens": output },
        }))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_tool_conversation_translates_both_ways() {
            let openai = json!({
                "model": "claude", "provider": "anthropic",
                "messages": [
                    { "role": "system", "content": "be brief" },
                    { "role": "user", "content": "where is 42?" },
                    { "role": "assistant", "content": null, "tool_calls": [
                        { "id": "t1", "type": "function",
                          "function": { "name": "order_status", "arguments": "{\"order\":\"42\"}" } },
                        { "id": "t2", "type": "function",
                          "function": { "name": "order_status", "arguments": "{\"order\":\"43\"}" } }] },
                    { "role": "tool", "tool_call_id": "t1", "content": "in transit" },
                    { "role": "tool", "tool_call_id": "t2", "content": "delivered" },
                ],
                "tools": [{ "type": "function", "function": {
                    "name": "order_status", "description": "d", "parameters": { "type": "object" } } }],
            });
            let req = request(&openai);
            assert_eq!(req["system"], "be brief");
            assert_eq!(req["max_tokens"], ANTHROPIC_DEFAULT_MAX_TOKENS);
            assert!(req.get("provider").is_none());
            let m = req["messages"].as_array().unwrap();
            assert_eq!(m.len(), 3, "{req}");
            assert_eq!(m[1]["content"][1]["type"], "tool_use");
            assert_eq!(m[1]["content"][0]["input"]["order"], "42");
            assert_eq!(m[2]["role"], "user");
            assert_eq!(
                m[2]["content"].as_array().unwrap().len(),
                2,
                "results merged"
            );
            assert_eq!(m[2]["content"][1]["tool_use_id"], "t2");
            assert_eq!(req["tools"][0]["input_schema"]["type"], "object");

            let answer = response(&json!({
                "id": "msg_1", "model": "claude", "stop_reason": "tool_use",
                "content": [{ "type": "text", "text": "checking" },
                            { "type": "tool_use", "id": "t3", "name": "order_status", "input": { "order": "44" } }],
                "usage": { "input_tokens": 11, "output_tokens": 5 },
            }))
            .unwrap();
            let msg = &answer["choices"][0]["message"];
            assert_eq!(msg["content"], "checking");
            assert_eq!(
                msg["tool_calls"][0]["function"]["arguments"],
                "{\"order\":\"44\"}"
            );
            assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");
            assert_eq!(answer["usage"]["prompt_tokens"], 11);
            assert!(response(&json!({ "error": "x" })).is_err());
        }
    }
}
