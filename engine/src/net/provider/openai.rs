//! OpenAI's chat-completions format: the request is sent as it is (without
//! onceflow's `"provider"` field) to `{OPENAI_BASE_URL}/chat/completions`
//! with a bearer token, the answer already is a chat completion, and a
//! stream is its `chat.completion.chunk` events ending at `data: [DONE]`,
//! with the usage asked for in the last chunk.

use serde_json::{json, Value};

use super::config::ProviderConfig;
use super::format::{Answer, WireFormat};

/// OpenAI chat completions (and every gateway that speaks them).
#[derive(Debug)]
pub struct OpenAiChat;

impl WireFormat for OpenAiChat {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn endpoint(&self, config: &ProviderConfig) -> (String, Vec<(&'static str, String)>) {
        let mut headers = Vec::new();
        if let Some(api_key) = &config.api_key {
            headers.push(("authorization", format!("Bearer {api_key}")));
        }
        let url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        (url, headers)
    }

    fn body(&self, request: &Value, stream: bool) -> Value {
        let mut body = request.clone();
        if let Some(o) = body.as_object_mut() {
            // `provider` is onceflow's own field: it is not sent.
            o.remove("provider");
            if stream {
                o.insert("stream".into(), Value::Bool(true));
                o.insert("stream_options".into(), json!({ "include_usage": true }));
            }
        }
        body
    }

    fn answer(&self, response: Value) -> Result<Value, String> {
        Ok(response)
    }

    fn event(&self, answer: &mut Answer, data: &str) -> Result<Option<String>, String> {
        if data.trim() == "[DONE]" {
            answer.done = true;
            return Ok(None);
        }
        let event = answer.event(data)?;
        answer.first_of(&event, "id", "model");
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            answer.usage = Some(usage.clone());
        }
        let choice = &event["choices"][0];
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            answer.finish_reason = Some(reason.clone());
        }
        for delta in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            answer.tool_call(delta)?;
        }
        match choice["delta"]["content"].as_str() {
            Some(text) if !text.is_empty() => Ok(Some(answer.text(text))),
            _ => Ok(None),
        }
    }

    fn stream_end(&self) -> &'static str {
        "data: [DONE]"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_goes_as_it_is_without_onceflows_field() {
        let request = json!({ "model": "m", "provider": "openai", "messages": [] });
        let body = OpenAiChat.body(&request, false);
        assert_eq!(body, json!({ "model": "m", "messages": [] }));
        let streamed = OpenAiChat.body(&request, true);
        assert_eq!(streamed["stream"], true);
        assert_eq!(streamed["stream_options"]["include_usage"], true);
        let config = ProviderConfig {
            base_url: "http://p/v1/".into(),
            api_key: Some("sk".into()),
            ..ProviderConfig::default()
        };
        let (url, headers) = OpenAiChat.endpoint(&config);
        assert_eq!(url, "http://p/v1/chat/completions");
        assert_eq!(headers, vec![("authorization", "Bearer sk".to_owned())]);
    }

    #[test]
    fn events_split_at_blank_lines_make_the_answer() {
        let mut a = Answer::new(&OpenAiChat);
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
        let mut a = Answer::new(&OpenAiChat);
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
}
