//! # onceflow-engine
//!
//! The runtime of onceflow, a durable, actor-based workflow engine for LLM
//! jobs. Three wings sit beside the store, the context and the API:
//! [`rules`] (pure decisions), [`net`] (the network edge) and [`node`]
//! (what runs on one node). A tour in the order a job travels:
//!
//! * [`api`] — `POST /v1/jobs` validates ([`node::intake`]) a typed
//!   [`request`] and records the job in `received`; the job id is the
//!   client's business id and the database's primary key decides races.
//!   A node with room takes the new job at once ([`node::handoff`]).
//! * [`node::supervisor`] — one actix actor per node: leases runnable jobs
//!   (`FOR NO KEY UPDATE SKIP LOCKED`), woken by `LISTEN/NOTIFY`, renews
//!   leases in one batched statement, and resumes jobs whose lease expired.
//! * [`node::actor`] — one actix actor per job attempt, driving the
//!   lifecycle ([`rules::lifecycle`]: received → generated → persisted →
//!   claimed → delivered → acked, or dead) from its last checkpoint; it
//!   reports to the supervisor.
//! * [`workflow`] + [`context`] — user workflows in Rust; every side effect
//!   goes through the durable context, journaled under a key from
//!   [`rules::keys`].
//! * [`net`] — the model call ([`net::provider`], one file per wire
//!   format), the completion webhook ([`net::webhook`]), one classified
//!   HTTP POST ([`net::outbound`]) and the SSRF guard ([`net::guard`]).
//! * [`rules`] — what a failure means ([`rules::verdict`], over
//!   [`rules::failure`]), backoff ([`rules::retry`]), provider limits and
//!   their arithmetic ([`rules::quota`]), how a wait ends
//!   ([`rules::wait_machine`]), a signal's rules ([`rules::signal`]), a
//!   cron's fire times ([`rules::schedule`]), the events a consumer is sent
//!   ([`rules::event`]) and W3C trace context ([`rules::traceparent`]: one
//!   trace per job across its attempts): decided with no I/O.
//! * [`limiter`] — model calls waiting their turn on a quota; [`hub`] —
//!   this node's watchers of streamed jobs and of token changes (in
//!   memory). Both are used by the [`context`], so they sit below it, out
//!   of the `node` wing.
//! * [`store`] — all SQL; [`db`] the pool and migrations; [`pg`] the embedded
//!   PostgreSQL.
//! * [`node::shared`] — what a node's actors share; [`node::runtime`] —
//!   starting a node ([`Engine`]).
//! * [`attempt_spans`] — the OpenTelemetry spans and metrics of each
//!   attempt; [`error`] — every error type.
//! * [`faults`] — named failpoints at every boundary, for tests and the demo;
//!   `testkit` (feature) — throwaway PostgreSQL, fake provider and consumer,
//!   the test harness and the crash-point explorer.
//!
//! Each module imports only modules below it, and the wings import each
//! other in one direction: the layers are drawn in
//! `docs/design/architecture.md` and enforced by `tests/layers.rs`.
//! `LIFECYCLE.md` beside this crate documents states, transitions, guards and
//! which invariants the schema enforces.

#![warn(missing_docs)]

pub mod api;
pub mod attempt_spans;
pub mod context;
pub mod db;
pub mod error;
pub mod faults;
pub mod hub;
pub mod limiter;
pub mod net;
pub mod node;
pub mod pg;
pub mod request;
pub mod rules;
pub mod store;
pub mod workflow;

pub use context::{Context, SendMode, StepInvocation, ToolCall, ToolInvocation};
pub use db::Db;
pub use error::{ErrorEnvelope, StepError, StoreError};
pub use faults::{Action, FailPoint, Faults};
pub use net::guard::UrlGuard;
pub use node::runtime::Engine;
pub use node::shared::EngineConfig;
pub use request::Throttle;
pub use rules::lifecycle::JobState;
pub use store::Store;
pub use workflow::{DeliveryPolicy, InvalidInput, Registry, Workflow};

#[cfg(feature = "testkit")]
pub mod testkit;
