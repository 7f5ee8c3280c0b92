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

pub use crate::error::InvalidInput;
pub use crate::rules::verdict::DeliveryPolicy;

/// A user-defined workflow.
pub trait Workflow: Send + Sync + 'static {
    /// The durable name: stored with every job, so never derived from the type name
    /// and never changed once jobs exist.
    const NAME: &'static str;
    /// The version of the body (default 1). A job records the version it
    /// started on and only a node that has that version runs it, so a body
    /// that changes what it journals (another step, another order, another
    /// request) ships as a new version registered *beside* the old one until
    /// the old one's jobs are finished. See "Changing a workflow" in docs/guide/workflows.md.
    const VERSION: u32 = 1;
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

    /// The most jobs of this workflow that run at once per
    /// `concurrency_key` of one tenant, across every node (default: none
    /// set; a token's own limit, or 1). When both this and the token set
    /// one, the smaller holds. Taken at intake: a change applies to jobs
    /// submitted after it.
    fn concurrency_per_key(&self) -> Option<u32> {
        None
    }

    /// At most this many jobs of this workflow start per period per
    /// `concurrency_key` of one tenant, across every node (default: none;
    /// a token's own throttle, if set). When both this and the token set
    /// one, the fewer starts over the longer period holds (at least as
    /// strict as each). Taken at intake, like
    /// [`concurrency_per_key`](Self::concurrency_per_key); the concurrency
    /// limit holds beside it.
    fn throttle_per_key(&self) -> Option<crate::request::Throttle> {
        None
    }

    /// Checks an input beyond its type (non-empty lists, ranges). Runs at intake.
    fn validate(_input: &Self::Input) -> Result<(), InvalidInput> {
        Ok(())
    }

    /// Checks an input against this registered instance, after
    /// [`validate`](Self::validate): what only the instance knows, such as
    /// the tools it was given. Runs at `POST /v1/jobs` on the node that
    /// takes the job, not when a body starts it as a child (default:
    /// accepts).
    fn validate_here(&self, _input: &Self::Input) -> Result<(), InvalidInput> {
        Ok(())
    }

    /// The input's JSON Schema, shown in `GET /v1/openapi.json` as this
    /// workflow's `input` (default: none, any JSON object). Describe what
    /// [`validate`](Self::validate) accepts; intake still decides.
    fn input_schema() -> Option<Value> {
        None
    }

    /// The output's JSON Schema, shown in `GET /v1/openapi.json` (with a
    /// token) as the component `Result_{NAME}`: what a finished job's
    /// `result` holds (default: none, any JSON).
    fn output_schema() -> Option<Value> {
        None
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
    /// [`Workflow::NAME`].
    fn name(&self) -> &'static str;
    /// [`Workflow::VERSION`].
    fn version(&self) -> u32;
    /// [`Workflow::delivery`].
    fn delivery_policy(&self) -> DeliveryPolicy;
    /// [`Workflow::failure_events`].
    fn failure_events(&self) -> bool;
    /// [`Workflow::concurrency_per_key`].
    fn concurrency_per_key(&self) -> Option<u32>;
    /// [`Workflow::throttle_per_key`], within its bounds.
    fn throttle_per_key(&self) -> Option<crate::request::Throttle>;
    /// Decodes `input` into the workflow's input type and runs
    /// [`Workflow::validate`], then [`Workflow::validate_here`]: intake's
    /// check of a submitted job.
    fn validate(&self, input: &Value) -> Result<(), InvalidInput>;
    /// Decodes `input` and runs [`Workflow::validate`] alone: what does not
    /// depend on the node, checked again on every replay of a body that
    /// starts the job as a child.
    fn validate_input(&self, input: &Value) -> Result<(), InvalidInput>;
    /// [`Workflow::input_schema`].
    fn input_schema(&self) -> Option<Value>;
    /// [`Workflow::output_schema`].
    fn output_schema(&self) -> Option<Value>;
    /// Decodes `input`, runs the body and serialises its output. The input
    /// is borrowed: a job in flight keeps one copy of it (its decoded form
    /// lives in the body's future).
    fn run<'a>(
        &'a self,
        ctx: &'a mut Context,
        input: &'a Value,
    ) -> BoxFuture<'a, Result<Value, StepError>>;
}

impl<W: Workflow> DynWorkflow for W {
    fn name(&self) -> &'static str {
        W::NAME
    }

    fn version(&self) -> u32 {
        W::VERSION
    }

    fn delivery_policy(&self) -> DeliveryPolicy {
        Workflow::delivery(self)
    }

    fn failure_events(&self) -> bool {
        Workflow::failure_events(self)
    }

    fn concurrency_per_key(&self) -> Option<u32> {
        Workflow::concurrency_per_key(self).map(|n| n.clamp(1, 1000))
    }

    fn throttle_per_key(&self) -> Option<crate::request::Throttle> {
        Workflow::throttle_per_key(self).map(|t| crate::request::Throttle::new(t.starts, t.per))
    }

    fn validate(&self, input: &Value) -> Result<(), InvalidInput> {
        let typed = decode::<W::Input>(input)?;
        W::validate(&typed)?;
        W::validate_here(self, &typed)
    }

    fn validate_input(&self, input: &Value) -> Result<(), InvalidInput> {
        W::validate(&decode::<W::Input>(input)?)
    }

    fn input_schema(&self) -> Option<Value> {
        W::input_schema()
    }

    fn output_schema(&self) -> Option<Value> {
        W::output_schema()
    }

    fn run<'a>(
        &'a self,
        ctx: &'a mut Context,
        input: &'a Value,
    ) -> BoxFuture<'a, Result<Value, StepError>> {
        async move {
            let typed = decode::<W::Input>(input).map_err(StepError::invalid_input)?;
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

/// The workflows an engine runs, by durable name and version.
#[derive(Clone, Default)]
pub struct Registry {
    by_name: BTreeMap<&'static str, BTreeMap<u32, Arc<dyn DynWorkflow>>>,
    /// Every workflow sends failure events (`ONCEFLOW_FAILURE_EVENTS`).
    failure_events: bool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.runnable()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `workflow` under its `NAME` and `VERSION`. Several versions
    /// of one name may be registered: new jobs start on the highest, and a
    /// job already started runs on its own. Panics on a duplicate name and
    /// version (two bodies would run each other's jobs) and on version 0.
    pub fn register<W: Workflow>(&mut self, workflow: W) -> &mut Self {
        self.insert(W::NAME, W::VERSION, Arc::new(workflow));
        self
    }

    fn insert(&mut self, name: &'static str, version: u32, workflow: Arc<dyn DynWorkflow>) {
        assert!(
            (1..=i32::MAX as u32).contains(&version),
            "workflow {name:?}: VERSION must be at least 1"
        );
        let previous = self
            .by_name
            .entry(name)
            .or_default()
            .insert(version, workflow);
        assert!(
            previous.is_none(),
            "workflow {name:?} version {version} registered twice"
        );
    }

    /// The version new jobs of `name` start on: the highest registered.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn DynWorkflow>> {
        self.by_name.get(name)?.values().next_back()
    }

    /// Version `version` of `name`, if this node has it.
    pub fn get_version(&self, name: &str, version: i32) -> Option<&Arc<dyn DynWorkflow>> {
        self.by_name.get(name)?.get(&u32::try_from(version).ok()?)
    }

    /// The registered names, owned (for a query parameter).
    pub fn owned_names(&self) -> Vec<String> {
        self.names().map(str::to_owned).collect()
    }

    /// The registered workflow names, in order, each once whatever its versions.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.by_name.keys().copied()
    }

    /// Every registered `name@version`: the jobs this node can run.
    pub fn runnable(&self) -> Vec<String> {
        self.by_name
            .iter()
            .flat_map(|(name, versions)| versions.keys().map(move |v| format!("{name}@{v}")))
            .collect()
    }

    /// Registers every workflow of `other` too. Panics on a name and version
    /// registered in both.
    pub fn extend(&mut self, other: &Registry) -> &mut Self {
        for (name, versions) in &other.by_name {
            for (version, workflow) in versions {
                self.insert(name, *version, workflow.clone());
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Body<const V: u32>;

    impl<const V: u32> Workflow for Body<V> {
        const NAME: &'static str = "body";
        const VERSION: u32 = V;
        type Input = Value;
        type Output = u32;

        async fn run(&self, _ctx: &mut Context, _input: Value) -> Result<u32, StepError> {
            Ok(V)
        }
    }

    #[test]
    fn new_jobs_start_on_the_highest_version_and_every_version_stays_runnable() {
        let mut registry = Registry::new();
        registry.register(Body::<2>).register(Body::<1>);
        assert_eq!(registry.get("body").unwrap().version(), 2);
        assert_eq!(registry.get_version("body", 1).unwrap().version(), 1);
        assert!(registry.get_version("body", 3).is_none());
        assert!(registry.get_version("body", -1).is_none());
        assert_eq!(registry.runnable(), ["body@1", "body@2"]);
        let mut other = Registry::new();
        other.register(Body::<3>);
        registry.extend(&other);
        assert_eq!(registry.get("body").unwrap().version(), 3);
    }

    #[test]
    #[should_panic(expected = "version 2 registered twice")]
    fn one_version_registered_twice_panics() {
        Registry::new().register(Body::<2>).register(Body::<2>);
    }

    #[test]
    #[should_panic(expected = "VERSION must be at least 1")]
    fn version_zero_panics() {
        Registry::new().register(Body::<0>);
    }
}
