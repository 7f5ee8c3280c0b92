//! The workflow API: a workflow is a Rust type with a durable name, a typed
//! input and output, and a body that runs through the durable [`Context`].
//!
//! The engine owns the lifecycle around the body: once the body returns, the
//! job is checkpointed `generated`, its output persisted, its completion
//! webhook claimed, delivered and acked. A body must do its side effects only
//! through the context, so that a rerun after a crash replays them from the
//! journal instead of doing them again.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::context::Context;
use crate::error::StepError;

/// What happens to a completion webhook whose request may have been sent but
/// whose outcome was never recorded (a crash mid-request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryPolicy {
    /// Send again with the same `Idempotency-Key`/`webhook-id`; the consumer
    /// drops the repeat. The default.
    AtLeastOnce,
    /// Never send twice: the outbox row becomes `unknown` and the job is
    /// dead-lettered for a human.
    AtMostOnce,
}

/// A workflow's input failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidInput {
    /// The offending field, as a dotted path from the request root (`input.messages`).
    pub field: String,
    pub message: String,
}

impl InvalidInput {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidInput {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A user-defined workflow.
pub trait Workflow: Send + Sync + 'static {
    /// The durable name: stored with every job, so never derived from the type name
    /// and never changed once jobs exist.
    const NAME: &'static str;
    /// The job's `input`, as submitted.
    type Input: DeserializeOwned + Send + 'static;
    /// What the body returns; persisted and sent as the webhook's `result`.
    type Output: Serialize + Send + 'static;

    /// Delivery policy of the completion webhook (default: at-least-once with a stable key).
    fn delivery(&self) -> DeliveryPolicy {
        DeliveryPolicy::AtLeastOnce
    }

    /// Whether a job that ends `dead` or `cancelled` sends a `job.dead` /
    /// `job.cancelled` webhook (key `job:{id}:dead` / `job:{id}:cancelled`),
    /// so consumers learn of failures without polling. Default: no (a node
    /// can turn it on for every workflow, `ONCEFLOW_FAILURE_EVENTS`).
    fn failure_events(&self) -> bool {
        false
    }

    /// Checks an input beyond its type (non-empty lists, ranges). Runs at intake.
    fn validate(_input: &Self::Input) -> Result<(), InvalidInput> {
        Ok(())
    }

    /// The body. Every side effect goes through `ctx`.
    fn run(
        &self,
        ctx: &mut Context,
        input: Self::Input,
    ) -> impl Future<Output = Result<Self::Output, StepError>> + Send;
}

/// A workflow with its types erased, as the engine stores it.
pub trait DynWorkflow: Send + Sync {
    fn name(&self) -> &'static str;
    fn delivery_policy(&self) -> DeliveryPolicy;
    fn failure_events(&self) -> bool;
    fn validate(&self, input: &Value) -> Result<(), InvalidInput>;
    fn run<'a>(
        &'a self,
        ctx: &'a mut Context,
        input: Value,
    ) -> BoxFuture<'a, Result<Value, StepError>>;
}

impl<W: Workflow> DynWorkflow for W {
    fn name(&self) -> &'static str {
        W::NAME
    }

    fn delivery_policy(&self) -> DeliveryPolicy {
        Workflow::delivery(self)
    }

    fn failure_events(&self) -> bool {
        Workflow::failure_events(self)
    }

    fn validate(&self, input: &Value) -> Result<(), InvalidInput> {
        let typed = decode::<W::Input>(input)?;
        W::validate(&typed)
    }

    fn run<'a>(
        &'a self,
        ctx: &'a mut Context,
        input: Value,
    ) -> BoxFuture<'a, Result<Value, StepError>> {
        async move {
            let typed = decode::<W::Input>(&input).map_err(StepError::invalid_input)?;
            let output = Workflow::run(self, ctx, typed).await?;
            serde_json::to_value(output).map_err(|e| StepError::Serialize(e.to_string()))
        }
        .boxed()
    }
}

fn decode<T: DeserializeOwned>(input: &Value) -> Result<T, InvalidInput> {
    serde_path_to_error::deserialize(input).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." || path.is_empty() {
            "input".to_owned()
        } else {
            format!("input.{path}")
        };
        InvalidInput::new(field, e.into_inner().to_string())
    })
}

/// The workflows an engine runs, by durable name.
#[derive(Clone, Default)]
pub struct Registry {
    by_name: BTreeMap<&'static str, Arc<dyn DynWorkflow>>,
    /// Every workflow sends failure events (`ONCEFLOW_FAILURE_EVENTS`).
    failure_events: bool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.by_name.keys()).finish()
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `workflow` under its `NAME`. Panics on a duplicate name: two
    /// workflows sharing a durable name would run each other's jobs.
    pub fn register<W: Workflow>(&mut self, workflow: W) -> &mut Self {
        let previous = self.by_name.insert(W::NAME, Arc::new(workflow));
        assert!(
            previous.is_none(),
            "workflow {:?} registered twice",
            W::NAME
        );
        self
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn DynWorkflow>> {
        self.by_name.get(name)
    }

    /// The registered names, owned (for a query parameter).
    pub fn owned_names(&self) -> Vec<String> {
        self.names().map(str::to_owned).collect()
    }

    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.by_name.keys().copied()
    }

    /// Registers every workflow of `other` too. Panics on a name registered
    /// in both.
    pub fn extend(&mut self, other: &Registry) -> &mut Self {
        for (name, workflow) in &other.by_name {
            let previous = self.by_name.insert(name, workflow.clone());
            assert!(previous.is_none(), "workflow {name:?} registered twice");
        }
        self
    }

    /// Makes every workflow send failure events (`job.dead`, `job.cancelled`).
    pub fn with_failure_events(&mut self, on: bool) -> &mut Self {
        self.failure_events = on;
        self
    }

    /// Whether jobs of `workflow` send failure events.
    pub fn failure_events(&self, workflow: &str) -> bool {
        self.failure_events || self.get(workflow).is_some_and(|w| w.failure_events())
    }
}
