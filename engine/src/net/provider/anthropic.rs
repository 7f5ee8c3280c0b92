//! Anthropic's Messages API behind the chat-completions interface: a
//! request is translated to a Messages request (system prompt,
//! `tool_use`/`tool_result` blocks, tools) sent to
//! `{ANTHROPIC_BASE_URL}/v1/messages` with `x-api-key` and
//! `anthropic-version`, and the answer — whole or as Messages events — is
//! read back into a chat completion (text, tool calls, finish reason,
//! usage). Anthropic ignores the `Idempotency-Key`: a retry after a lost
//! answer may be billed again; the journal still keeps one result and one
//! delivery.

use serde_json::{json, Map, Value};

use super::config::ProviderConfig;
use super::format::{Answer, WireFormat};

/// The `anthropic-version` header onceflow speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `max_tokens` sent to Anthropic (which requires it) when a job sets none.
pub const ANTHROPIC_DEFAULT_MAX_TOKENS: u64 = 1024;

/// The Anthropic Messages API.
#[derive(Debug)]
pub struct AnthropicMessages;

impl WireFormat for AnthropicMessages {
    fn name(&self) -> &'static str {
        "anthropic"
    }

    fn endpoint(&self, config: &ProviderConfig) -> (String, Vec<(&'static str, String)>) {
        let mut headers = Vec::new();
        if let Some(api_key) = &config.anthropic_api_key {
            headers.push(("x-api-key", api_key.clone()));
        }
        headers.push(("anthropic-version", ANTHROPIC_VERSION.to_owned()));
        let url = format!(
            "{}/v1/messages",
            config.anthropic_base_url.trim_end_matches('/')
        );
        (url, headers)
    }

    fn body(&self, request: &Value, stream: bool) -> Value {
        let mut body = self::request(request);
        if stream {
            body["stream"] = Value::Bool(true);
        }
        body
    }

    fn answer(&self, response: Value) -> Result<Value, String> {
        self::response(&response)
    }

    /// Messages events: `message_start` (id, model, input tokens),
    /// `content_block_start` (a text block, or a `tool_use` block's id and
    /// name), `content_block_delta` (`text_delta`, or a tool's
    /// `input_json_delta`), `message_delta` (stop reason, output tokens),
    /// `message_stop` (the end), `error`. Others (`ping`,
    /// `content_block_stop`) carry nothing to keep.
    fn event(&self, answer: &mut Answer, data: &str) -> Result<Option<String>, String> {
        let event = answer.event(data)?;
        match event["type"].as_str() {
            Some("message_start") => {
                let message = &event["message"];
                answer.id = message.get("id").cloned();
                answer.model = message.get("model").cloned();
                answer.usage = Some(json!({
                    "prompt_tokens": message["usage"]["input_tokens"],
                    "completion_tokens": message["usage"]["output_tokens"],
                }));
            }
            Some("content_block_start") => {
                let block = &event["content_block"];
                if block["type"] == "tool_use" {
                    // The same head an OpenAI stream's first piece has; an
                    // input given whole here (not streamed as pieces) is the
                    // call's arguments.
                    let whole = block["input"]
                        .as_object()
                        .filter(|o| !o.is_empty())
                        .map(|o| Value::Object(o.clone()).to_string());
                    answer.tool_call(&json!({
                        "index": event["index"],
                        "id": block["id"],
                        "type": "function",
                        "function": { "name": block["name"], "arguments": whole },
                    }))?;
                } else if let Some(text) = block["text"].as_str().filter(|t| !t.is_empty()) {
                    return Ok(Some(answer.text(text)));
                }
            }
            Some("content_block_delta") => {
                let delta = &event["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => {
                        if let Some(text) = delta["text"].as_str().filter(|t| !t.is_empty()) {
                            return Ok(Some(answer.text(text)));
                        }
                    }
                    Some("input_json_delta") => {
                        let index = event["index"].as_u64();
                        if !index.is_some_and(|i| answer.has_tool_call(i)) {
                            return Err("an input_json_delta for no tool_use block".to_owned());
                        }
                        answer.tool_call(&json!({
                            "index": index,
                            "function": { "arguments": delta["partial_json"] },
                        }))?;
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let Some(reason) = event["delta"]["stop_reason"].as_str() {
                    answer.finish_reason = Some(json!(finish_reason(reason)));
                }
                // Counts here are cumulative: they replace message_start's.
                if let Some(usage) = answer.usage.as_mut() {
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
            Some("message_stop") => answer.done = true,
            _ => {}
        }
        Ok(None)
    }

    fn stream_end(&self) -> &'static str {
        "message_stop"
    }

    /// As the whole answer reads: `"content": ""` beside tool calls, a
    /// `tool_use` block whose input streamed no pieces has the input `{}`,
    /// and `"provider": "anthropic"`.
    fn finish(&self, completion: &mut Value) {
        let message = &mut completion["choices"][0]["message"];
        if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for call in calls {
                if call["function"]["arguments"] == "" {
                    call["function"]["arguments"] = json!("{}");
                }
            }
            if message["content"].is_null() {
                message["content"] = json!("");
            }
        }
        completion["provider"] = json!("anthropic");
    }
}

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

    #[test]
    fn anthropic_events_make_the_same_completion_as_the_whole_answer() {
        let mut a = Answer::new(&AnthropicMessages);
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
        let whole = response(&json!({
            "id": "msg_1", "model": "claude-x", "stop_reason": "tool_use",
            "content": [
                { "type": "text", "text": "Let me look." },
                { "type": "tool_use", "id": "toolu_1", "name": "lookup", "input": { "order": "42" } },
                { "type": "tool_use", "id": "toolu_2", "name": "ping", "input": {} }],
            "usage": { "input_tokens": 25, "output_tokens": 30 },
        }))
        .unwrap();
        assert_eq!(streamed, whole);
        assert!(Answer::new(&AnthropicMessages)
            .take(r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#)
            .is_err());
        // An input given whole in the block's start is its arguments.
        let mut whole = Answer::new(&AnthropicMessages);
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
        assert!(Answer::new(&AnthropicMessages)
            .take(r#"{"type":"content_block_delta","index":5,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#)
            .is_err());
    }
}
