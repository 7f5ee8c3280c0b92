//! Tools a model may call, in Rust, and the built-in `http_post`.
//!
//! A tool's `execute` runs at most once per call position: the agent goes
//! through [`Context::tool`](onceflow_engine::Context::tool), which records
//! the call in the tool ledger before the side effect and its result after.
//! The [`ToolInvocation`] carries a stable `idempotency_key` for the tool's own
//! outbound request, so even a crash between the side effect and the ledger
//! write repeats the request under the same key.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use onceflow_engine::{StepError, ToolInvocation};
use serde_json::{json, Value};

/// A tool the model can call.
pub trait Tool: Send + Sync + 'static {
    /// The function name the model calls (a durable name: keep it stable).
    fn name(&self) -> &str;
    /// What the tool does, for the model.
    fn description(&self) -> &str;
    /// The JSON schema of the arguments.
    fn parameters(&self) -> Value;
    /// Does the side effect; the returned text is what the model reads (stored
    /// and replayed byte for byte).
    fn execute(
        &self,
        call: ToolInvocation,
        arguments: Value,
    ) -> BoxFuture<'_, Result<String, StepError>>;

    /// The OpenAI `tools` entry for this tool.
    fn definition(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name(),
                "description": self.description(),
                "parameters": self.parameters(),
            }
        })
    }
}

/// The built-in tool: POSTs its arguments as JSON to a configured URL with
/// the call's `Idempotency-Key` (and `tool-call-id`), and returns the
/// response body. Operators see every side effect at that URL.
#[derive(Debug, Clone)]
pub struct HttpPost {
    name: String,
    description: String,
    url: String,
}

impl HttpPost {
    /// The name the model sees by default.
    pub const DEFAULT_NAME: &'static str = "http_post";

    /// A tool named `http_post` that posts to `url`.
    pub fn new(url: impl Into<String>) -> Self {
        HttpPost {
            name: Self::DEFAULT_NAME.to_owned(),
            description:
                "Send a JSON message to the operator's endpoint (a ticket, a notification). \
                          Returns the endpoint's answer."
                    .to_owned(),
            url: url.into(),
        }
    }

    /// Renames the tool and describes it for the model.
    pub fn named(mut self, name: impl Into<String>, description: impl Into<String>) -> Self {
        self.name = name.into();
        self.description = description.into();
        self
    }
}

impl Tool for HttpPost {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> Value {
        json!({ "type": "object", "additionalProperties": true })
    }

    fn execute(
        &self,
        call: ToolInvocation,
        arguments: Value,
    ) -> BoxFuture<'_, Result<String, StepError>> {
        async move { call.post_json(&self.url, &arguments).await }.boxed()
    }
}
