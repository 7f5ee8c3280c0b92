//! The workflow and the tool of this crate, so that `main` and the tests
//! share them.

use onceflow::{BoxFuture, Context, StepError, Tool, ToolInvocation, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Greets someone by name, with one model call.
pub struct Greet;

#[derive(Serialize, Deserialize)]
pub struct Who {
    pub name: String,
}

#[derive(Serialize, Deserialize)]
pub struct Greeting {
    pub greeting: String,
}

impl Workflow for Greet {
    const NAME: &'static str = "greet";
    type Input = Who;
    type Output = Greeting;

    // Shown in this node's `GET /v1/openapi.json` (with a token), so a
    // client generated from it types a greet job's input and result.
    fn input_schema() -> Option<Value> {
        Some(json!({
            "type": "object", "required": ["name"], "additionalProperties": false,
            "properties": { "name": { "type": "string", "description": "Who to greet." } },
        }))
    }

    fn output_schema() -> Option<Value> {
        Some(json!({
            "type": "object", "required": ["greeting"],
            "properties": { "greeting": { "type": "string", "description": "The model's one line." } },
        }))
    }

    async fn run(&self, ctx: &mut Context, who: Who) -> Result<Greeting, StepError> {
        let request = json!({
            "model": "gpt-4o-mini",
            "messages": [{ "role": "user", "content": format!("Greet {} in one line.", who.name) }],
        });
        // Journaled under `job:{id}:greet`: a retry replays it, never pays twice.
        let answer = ctx.generate("greet", &request).await?;
        let greeting = answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Ok(Greeting { greeting })
    }
}

/// A tool for the built-in agent: an order's status (a fixed table here).
pub struct OrderStatus;

impl Tool for OrderStatus {
    fn name(&self) -> &str {
        "order_status"
    }

    fn description(&self) -> &str {
        "Look up the shipping status of an order by its number."
    }

    fn parameters(&self) -> Value {
        json!({ "type": "object", "properties": { "order": { "type": "string" } }, "required": ["order"] })
    }

    fn execute(
        &self,
        _call: ToolInvocation,
        arguments: Value,
    ) -> BoxFuture<'_, Result<String, StepError>> {
        Box::pin(async move {
            let order = arguments["order"].as_str().unwrap_or_default();
            Ok(json!({ "order": order, "status": "in transit" }).to_string())
        })
    }
}

pub mod digest;
pub mod refund;
pub use digest::Digest;
pub use refund::Refund;
