//! Server-sent events of streamed answers, format-neutral: [`Events`]
//! splits the bytes into events' data, and [`Answer`] assembles what a
//! [`WireFormat`]'s events carry (text, tool calls in pieces, finish
//! reason, usage) into one chat completion.

use serde_json::{json, Value};

use super::format::WireFormat;

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
        assert_eq!(e.push(b": a comment\n\n"), Vec::<String>::new());
        assert_eq!(e.pending(), 0);
    }
}
