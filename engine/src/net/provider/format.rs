//! The seam between onceflow and a provider's wire format. A workflow
//! always speaks OpenAI's chat-completions format; a [`WireFormat`] says
//! what is sent for such a request (URL, auth headers, body), and reads the
//! provider's answer — whole or as server-sent events — back into a chat
//! completion, so journals, keys, usage and workflows are the same for
//! every provider; [`Answer`] assembles what a format's stream events
//! carry (text, tool calls in pieces, finish reason, usage) into one chat
//! completion. A request names its format in onceflow's own `"provider"`
//! field (never sent); [`super::FORMATS`] lists them, the first being the
//! default.
//!
//! Adding a format is one new file beside this one implementing the trait,
//! and one line in [`super::FORMATS`] (plus its base URL and key in
//! [`ProviderConfig`] when it has its own).

use serde_json::{json, Value};

use super::config::ProviderConfig;

/// Most tool calls taken from one streamed answer.
pub const MAX_TOOL_CALLS: usize = 128;

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

/// The answer, assembled from its events by its format.
#[derive(Debug)]
pub struct Answer {
    /// The text so far.
    pub content: String,
    /// Events taken.
    pub chunks: usize,
    /// The stream's end arrived.
    pub done: bool,
    /// Bytes of text taken so far (the answer's and tool calls').
    pub size: usize,
    /// The answer's id, when an event gave it.
    pub id: Option<Value>,
    /// The model that answered, when an event gave it.
    pub model: Option<Value>,
    /// The chat-completion finish reason, when an event gave it.
    pub finish_reason: Option<Value>,
    /// The usage as a chat completion reports it, when an event gave it.
    pub usage: Option<Value>,
    /// Tool calls, by their `index`: each arrives as a first delta with
    /// its id, type and name, then its `arguments` in pieces.
    tool_calls: std::collections::BTreeMap<u64, Value>,
    format: &'static dyn WireFormat,
}

impl Answer {
    /// An answer read from `format`'s events.
    pub fn new(format: &'static dyn WireFormat) -> Self {
        Answer {
            content: String::new(),
            chunks: 0,
            done: false,
            size: 0,
            id: None,
            model: None,
            finish_reason: None,
            usage: None,
            tool_calls: Default::default(),
            format,
        }
    }

    /// Takes one event's data; returns the text it adds, if any.
    pub fn take(&mut self, data: &str) -> Result<Option<String>, String> {
        let format = self.format;
        format.event(self, data)
    }

    /// One event of the stream, counted; an error the provider reports
    /// in the stream (credentials redacted) fails it.
    pub fn event(&mut self, data: &str) -> Result<Value, String> {
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

    /// Keeps `event`'s `id` and `model` fields unless known already.
    pub fn first_of(&mut self, event: &Value, id: &str, model: &str) {
        for (field, slot) in [(id, &mut self.id), (model, &mut self.model)] {
            if slot.is_none() {
                *slot = event.get(field).cloned();
            }
        }
    }

    /// Adds a piece of the answer's text; returns it.
    pub fn text(&mut self, text: &str) -> String {
        self.size += text.len();
        self.content.push_str(text);
        text.to_owned()
    }

    /// Whether a tool call has started at `index`.
    pub fn has_tool_call(&self, index: u64) -> bool {
        self.tool_calls.contains_key(&index)
    }

    /// Adds one chat-completion `delta.tool_calls` entry to the call at its
    /// `index`.
    pub fn tool_call(&mut self, delta: &Value) -> Result<(), String> {
        let index = delta["index"]
            .as_u64()
            .ok_or("a tool-call delta without an index")?;
        if !self.tool_calls.contains_key(&index) && self.tool_calls.len() >= MAX_TOOL_CALLS {
            return Err(format!(
                "more than {MAX_TOOL_CALLS} tool calls in one answer"
            ));
        }
        let call = self.tool_calls.entry(index).or_insert_with(
            || json!({ "id": "", "type": "function", "function": { "name": "", "arguments": "" } }),
        );
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

    /// The chat completion the stream amounted to, as its format's whole
    /// answer reads.
    pub fn completion(&self, request: &Value) -> Value {
        let mut message = json!({ "role": "assistant", "content": self.content });
        if !self.tool_calls.is_empty() {
            if self.content.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = Value::Array(self.tool_calls.values().cloned().collect());
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
        if let Some(usage) = &self.usage {
            out["usage"] = usage.clone();
        }
        self.format.finish(&mut out);
        out
    }
}
