//! A onceflow node of your own: one workflow and one tool of yours, beside
//! the built-in `completion` and `agent`, with the whole `onceflow` command
//! line (`serve`, `submit`, `status`, `jobs`, `token`, …).
//!
//! ```sh
//! cargo run -- serve          # the API on 127.0.0.1:8080, embedded PostgreSQL
//! curl -X POST localhost:8080/v1/jobs -H 'content-type: application/json' \
//!   -d '{"id": "hi-1", "workflow": "greet", "input": {"name": "Ada"}, "webhook_url": "https://hooks.example.com/x"}'
//! ```

use onceflow::{BoxFuture, Context, StepError, Tool, ToolInvocation, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Greets someone by name, with one model call.
struct Greet;

#[derive(Deserialize)]
struct Who {
    name: String,
}

#[derive(Serialize)]
struct Greeting {
    greeting: String,
}

impl Workflow for Greet {
    const NAME: &'static str = "greet";
    type Input = Who;
    type Output = Greeting;

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
struct OrderStatus;

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

fn main() -> anyhow::Result<()> {
    onceflow::App::new().workflow(Greet).tool(OrderStatus).run()
}
