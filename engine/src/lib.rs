//! # onceflow-engine
//!
//! The runtime of onceflow, a durable, actor-based workflow engine for LLM
//! jobs. A tour in the order a job travels:
//!
//! * [`api`] — `POST /v1/jobs` validates ([`intake`]) a typed
//!   [`request`] and records the job in `received`; the job id is the
//!   client's business id and the database's primary key decides races.
//!   A node with room takes the new job at once ([`handoff`]).
//! * [`supervisor`] — one actix actor per node: leases runnable jobs
//!   (`FOR UPDATE SKIP LOCKED`), woken by `LISTEN/NOTIFY`, renews leases in
//!   one batched statement, and resumes jobs whose lease expired.
//! * [`actor`] — one actix actor per job attempt, driving the lifecycle
//!   ([`lifecycle`]: received → generated → persisted → claimed → delivered →
//!   acked, or dead) from its last checkpoint; it reports to the supervisor.
//! * [`workflow`] + [`context`] — user workflows in Rust; every side effect
//!   goes through the durable context, journaled under a key from [`keys`].
//! * [`provider`], [`webhook`], [`outbound`], [`retry`] — the model call, the
//!   completion webhook, one classified HTTP POST and backoff; [`verdict`] —
//!   what a failure means, decided with no I/O.
//! * [`quota`] — provider limits and their arithmetic (pure); [`limiter`]
//!   — calls waiting their turn on them.
//! * [`store`] — all SQL; [`db`] the pool and migrations; [`pg`] the embedded
//!   PostgreSQL.
//! * [`node`] — what a node's actors share; [`runtime`] — starting a node
//!   ([`Engine`]).
//! * [`traceparent`] — W3C trace context: one trace per job across its
//!   attempts; [`attempt_spans`] — the OpenTelemetry spans and metrics of
//!   each attempt.
//! * [`guard`] — the SSRF guard for caller- and model-chosen URLs;
//!   [`error`] — every error type.
//! * [`faults`] — named failpoints at every boundary, for tests and the demo;
//!   `testkit` (feature) — throwaway PostgreSQL, fake provider and consumer,
//!   the test harness and the crash-point explorer.
//!
//! Each module imports only modules below it: the layers are drawn in
//! `docs/design/architecture.md` and enforced by `tests/layers.rs`.
//! `LIFECYCLE.md` beside this crate documents states, transitions, guards and
//! which invariants the schema enforces.

#![warn(missing_docs)]

pub mod actor;
pub mod api;
pub mod attempt_spans;
pub mod context;
pub mod db;
pub mod error;
pub mod faults;
pub mod guard;
pub mod handoff;
pub mod intake;
pub mod keys;
pub mod lifecycle;
pub mod limiter;
pub mod node;
pub mod outbound;
pub mod pg;
pub mod provider;
pub mod quota;
pub mod request;
pub mod retry;
pub mod runtime;
pub mod schedule;
pub mod signal;
pub mod store;
pub mod supervisor;
pub mod traceparent;
pub mod verdict;
pub mod wait_machine;
pub mod webhook;
pub mod workflow;

pub use context::{Context, StepInvocation, ToolInvocation};
pub use db::Db;
pub use error::{ErrorEnvelope, StepError, StoreError};
pub use faults::{Action, FailPoint, Faults};
pub use guard::UrlGuard;
pub use lifecycle::JobState;
pub use node::EngineConfig;
pub use request::Throttle;
pub use runtime::Engine;
pub use store::Store;
pub use workflow::{DeliveryPolicy, InvalidInput, Registry, Workflow};

#[cfg(feature = "testkit")]
pub mod testkit;
