//! `completion`: call the model once with the job's messages; the answer is the result.

use onceflow_engine::{Context, DeliveryPolicy, InvalidInput, StepError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The step name of the model call; its key is `job:{id}:generate`.
pub const GENERATE: &str = "generate";

/// The built-in completion workflow.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    delivery: DeliveryPolicy,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            delivery: DeliveryPolicy::AtLeastOnce,
        }
    }
}

/// `input` of a completion job: an OpenAI chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionInput {
    /// The model to ask (non-empty).
    pub model: String,
    /// The conversation, at least one message.
    pub messages: Vec<Message>,
    /// Sampling temperature, 0 to 2 (provider default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Most tokens to generate, 1 to [`MAX_TOKENS`] (provider default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Which provider answers (default OpenAI).
    #[serde(default, skip_serializing_if = "ModelProvider::is_default")]
    pub provider: ModelProvider,
    /// Stream the answer: its chunks are journaled as they arrive and shown
    /// on `GET /v1/jobs/{id}/events`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
}

/// The provider a job's model calls go to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelProvider {
    /// OpenAI chat completions (`OPENAI_BASE_URL`).
    #[default]
    OpenAi,
    /// The Anthropic Messages API (`ANTHROPIC_BASE_URL`).
    Anthropic,
}

impl ModelProvider {
    /// Whether this is the default (OpenAI).
    pub fn is_default(&self) -> bool {
        *self == ModelProvider::OpenAi
    }

    /// Marks `request` for this provider. An OpenAI request is left as it
    /// always was, so its hash (the model-call key's identity) is unchanged.
    pub fn mark(self, request: &mut serde_json::Value) {
        if self == ModelProvider::Anthropic {
            request["provider"] = serde_json::json!("anthropic");
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

/// Who a chat message is from (serialised lowercase).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the model.
    System,
    /// The user.
    User,
    /// The model's own earlier answer.
    Assistant,
}

/// The result of a completion job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionOutput {
    /// The assistant message's text.
    pub content: String,
    /// The model that answered (as the provider reports it, else the one asked).
    pub model: String,
    /// Why the model stopped (`stop`, `length`, …), when reported.
    pub finish_reason: Option<String>,
    /// The provider's `usage` object (token counts), as reported.
    pub usage: Option<Value>,
}

/// Largest `max_tokens` accepted (above every current model's output limit).
pub const MAX_TOKENS: u32 = 1_000_000;

impl Workflow for Completion {
    const NAME: &'static str = "completion";
    type Input = CompletionInput;
    type Output = CompletionOutput;

    fn delivery(&self) -> DeliveryPolicy {
        self.delivery
    }

    fn output_schema() -> Option<Value> {
        Some(json!({
            "type": "object",
            "description": "The result of a `completion` job: the model's answer (every field present; `finish_reason` and `usage` null when the provider did not say).",
            "required": ["content", "model", "finish_reason", "usage"],
            "properties": {
                "content": { "type": "string", "description": "The assistant message's text." },
                "model": { "type": "string", "description": "The model that answered (as the provider reports it, else the one asked)." },
                "finish_reason": { "type": ["string", "null"], "description": "Why the model stopped (`stop`, `length`, …), when reported." },
                "usage": { "type": ["object", "null"], "description": "The provider's `usage` object (token counts), as reported." },
            },
        }))
    }

    fn input_schema() -> Option<Value> {
        Some(json!({
            "type": "object",
            "description": "An OpenAI-style chat request.",
            "required": ["model", "messages"],
            "additionalProperties": false,
            "properties": {
                "model": { "type": "string", "pattern": "\\S",
                    "description": "The model to ask (not blank)." },
                "messages": { "type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "description": "Other fields of a message are not sent.",
                    "properties": {
                        "role": { "enum": ["system", "user", "assistant"] },
                        "content": { "type": "string" },
                    },
                } },
                "temperature": { "type": "number", "minimum": 0, "maximum": 2,
                    "description": "0 to 2; 0 to 1 for provider anthropic." },
                "max_tokens": { "type": "integer", "minimum": 1, "maximum": MAX_TOKENS },
                "provider": { "enum": ["openai", "anthropic"], "default": "openai" },
                "stream": { "type": "boolean", "default": false,
                    "description": "Journal the answer's chunks as they arrive; watch them on GET /v1/jobs/{id}/events." },
            },
        }))
    }

    fn validate(input: &CompletionInput) -> Result<(), InvalidInput> {
        crate::validate_chat(&input.model, input.messages.len())?;
        if let Some(m) = input.max_tokens {
            if !(1..=MAX_TOKENS).contains(&m) {
                return Err(InvalidInput::new(
                    "input.max_tokens",
                    format!("must be between 1 and {MAX_TOKENS}"),
                ));
            }
        }
        if let Some(t) = input.temperature {
            if input.provider == ModelProvider::Anthropic && !(0.0..=1.0).contains(&t) {
                return Err(InvalidInput::new(
                    "input.temperature",
                    "must be between 0 and 1 for provider anthropic",
                ));
            }
            if !(0.0..=2.0).contains(&t) {
                return Err(InvalidInput::new(
                    "input.temperature",
                    "must be between 0 and 2",
                ));
            }
        }
        Ok(())
    }

    async fn run(
        &self,
        ctx: &mut Context,
        input: CompletionInput,
    ) -> Result<CompletionOutput, StepError> {
        let mut request = json!({ "model": input.model, "messages": input.messages });
        if let Some(t) = input.temperature {
            request["temperature"] = json!(t);
        }
        if let Some(m) = input.max_tokens {
            request["max_tokens"] = json!(m);
        }
        input.provider.mark(&mut request);
        if input.stream {
            // Part of the request's identity: a streamed call's key is its own.
            request["stream"] = json!(true);
        }
        let response = ctx.generate(GENERATE, &request).await?;
        let choice = &response["choices"][0];
        Ok(CompletionOutput {
            content: choice["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            model: response["model"]
                .as_str()
                .unwrap_or(&input.model)
                .to_owned(),
            finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
            usage: response.get("usage").cloned(),
        })
    }
}

impl Completion {
    /// The completion workflow with a chosen delivery policy (registered under
    /// another name by whoever needs both).
    pub fn with_delivery(delivery: DeliveryPolicy) -> Self {
        Completion { delivery }
    }
}
