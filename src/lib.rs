//! # onceflow
//!
//! A durable, actor-based workflow engine for LLM jobs, as a library: write
//! workflows in Rust and run a node of your own with them.
//!
//! ```no_run
//! use onceflow::{Context, StepError, Workflow};
//! use serde::{Deserialize, Serialize};
//!
//! struct Greet;
//!
//! #[derive(Deserialize)]
//! struct Who { name: String }
//!
//! #[derive(Serialize)]
//! struct Greeting { text: String }
//!
//! impl Workflow for Greet {
//!     const NAME: &'static str = "greet";
//!     type Input = Who;
//!     type Output = Greeting;
//!
//!     async fn run(&self, ctx: &mut Context, who: Who) -> Result<Greeting, StepError> {
//!         let request = serde_json::json!({
//!             "model": "gpt-4o-mini",
//!             "messages": [{ "role": "user", "content": format!("Greet {}", who.name) }],
//!         });
//!         let answer = ctx.generate("greet", &request).await?;
//!         let text = answer["choices"][0]["message"]["content"].as_str().unwrap_or_default();
//!         Ok(Greeting { text: text.to_owned() })
//!     }
//! }
//!
//! fn main() -> anyhow::Result<()> {
//!     onceflow::App::new().workflow(Greet).run()
//! }
//! ```
//!
//! The tour:
//!
//! * [`App`] — the `onceflow` command line (`serve`, `migrate`, `submit`,
//!   `status`, `watch`, `jobs`, `cancel`, `redrive`, `token`) with
//!   your workflows and tools registered beside the built-in `completion` and
//!   `agent`. The `onceflow` binary is `App::new().run()`.
//! * [`Workflow`], [`Context`], [`StepError`], [`DeliveryPolicy`],
//!   [`InvalidInput`] — the workflow contract: a durable name, typed input
//!   and output, and a body whose side effects go through the [`Context`]
//!   (`generate`, `tool`, `step`), each journaled under a key of the job.
//! * [`Tool`], [`ToolInvocation`] — tools for the `agent` workflow; each call
//!   runs once through the tool ledger.
//! * [`Client`] — the typed client of the HTTP API: submit jobs of a
//!   workflow type with its typed input, read, list, cancel and redrive them;
//!   every API error is a [`ClientError`].
//! * [`config`] — the flags and environment of the command line, and the
//!   database they name (the embedded PostgreSQL by default).
//! * [`engine`]: the engine's names a workflow's author may need beyond
//!   these (job states, failpoints, the test kit); [`workflows`] and
//!   [`observability`]: the crates underneath.
//!
//! The demo and the benchmarks, with the loopback fakes they drive, are the
//! `onceflow-bench` package beside this one: this library and the
//! `onceflow` binary do not compile the test kit.

#![warn(missing_docs)]

mod api_client;
mod cli;

pub use api_client::{
    Client, ClientError, HistoryRow, Job, JobSummary, ListQuery, Page, Submitted,
};
pub use cli::app::App;
pub use cli::config;
pub use onceflow_engine::{
    Context, DeliveryPolicy, InvalidInput, Registry, StepError, Throttle, ToolInvocation, Workflow,
};
pub use onceflow_workflows::{Agent, Completion, HttpPost, Tool};

/// The future a [`Tool`] returns.
pub use futures_util::future::BoxFuture;

/// What a workflow's author reaches for beyond the names above: job
/// states, failpoints to prove their own steps, the SSRF guard
/// and, with the feature `testkit`, the test kit. The runtime's insides
/// (the store, the actors, the supervisor, the API) are not part of this
/// library: `App` runs them.
pub mod engine {
    pub use onceflow_engine::{
        Action, ErrorEnvelope, FailPoint, Faults, JobState, StepInvocation, UrlGuard,
    };

    /// Loopback fakes, a throwaway PostgreSQL and the explorer, to test a
    /// workflow at every boundary (feature `testkit`).
    #[cfg(feature = "testkit")]
    pub use onceflow_engine::testkit;
}
/// The OpenTelemetry setup and names.
pub use onceflow_observability as observability;
/// The built-in workflows and tools.
pub use onceflow_workflows as workflows;
