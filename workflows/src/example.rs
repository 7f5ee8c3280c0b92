//! An example of a user's own workflow and tool, in a few dozen lines.
//!
//! `onboarding` asks the model for a welcome line, then creates the account
//! in the user's own system through a general step, passing the step's
//! stable key along so the accounts service can drop a repeat. Register it
//! next to the built-ins:
//!
//! ```no_run
//! let mut registry = onceflow_workflows::registry();
//! registry.register(onceflow_workflows::example::Onboarding::new("https://accounts.example/api"));
//! ```
//!
//! [`OrderStatus`] is an example tool: give it to an [`Agent`](crate::Agent)
//! with `Agent::new().with_tool(OrderStatus)`.

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use onceflow_engine::{Context, StepError, ToolInvocation, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::tool::Tool;

/// Welcomes a new user and creates their account, once.
#[derive(Debug, Clone)]
pub struct Onboarding {
    accounts_url: String,
}

impl Onboarding {
    /// The workflow, creating accounts by POSTing to `accounts_url`.
    pub fn new(accounts_url: impl Into<String>) -> Self {
        Onboarding {
            accounts_url: accounts_url.into(),
        }
    }
}

/// `input` of an onboarding job: the user to welcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewUser {
    /// Their email address, sent to the accounts service.
    pub email: String,
    /// Their name, used in the welcome line and the account.
    pub name: String,
}

/// The result of an onboarding job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Onboarded {
    /// The model's welcome line.
    pub welcome: String,
    /// The accounts service's answer (JSON, or its text as a string).
    pub account: Value,
}

impl Workflow for Onboarding {
    const NAME: &'static str = "example.onboarding";
    type Input = NewUser;
    type Output = Onboarded;

    async fn run(&self, ctx: &mut Context, user: NewUser) -> Result<Onboarded, StepError> {
        let prompt = format!(
            "Write one friendly line welcoming {} to our product.",
            user.name
        );
        let request =
            json!({ "model": "gpt-4o-mini", "messages": [{ "role": "user", "content": prompt }] });
        let answer = ctx.generate("welcome", &request).await?;
        let welcome = answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();

        let url = self.accounts_url.clone();
        let body = json!({ "job_id": ctx.job_id(), "email": user.email, "name": user.name });
        let account = ctx
            .step("create_account", |step| async move {
                let invocation = ToolInvocation {
                    job_id: step.job_id,
                    tool_call_id: String::new(),
                    idempotency_key: step.idempotency_key,
                    client: step.client,
                    timeout: std::time::Duration::from_secs(10),
                    traceparent: step.traceparent,
                    guard: step.guard,
                    response_limit: step.response_limit,
                };
                let text = invocation.post_json(&url, &body).await?;
                Ok(serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text)))
            })
            .await?;
        Ok(Onboarded { welcome, account })
    }
}

/// An example tool: looks an order up (here from a fixed table).
#[derive(Debug, Clone, Copy)]
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
        async move {
            let order = arguments["order"].as_str().unwrap_or_default();
            let status = if order.ends_with('7') {
                "delivered"
            } else {
                "in transit"
            };
            Ok(json!({ "order": order, "status": status }).to_string())
        }
        .boxed()
    }
}
