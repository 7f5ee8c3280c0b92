//! The test kit (feature `testkit`): what a workflow's author needs to prove
//! their own workflow survives redelivery, races and crashes by counting.
//!
//! * [`database`] — one throwaway PostgreSQL per test process, a fresh
//!   database per test cloned from a migrated template.
//! * [`FakeProvider`] / [`FakeConsumer`] — a model provider and a webhook
//!   consumer as real HTTP servers on 127.0.0.1 that record what they
//!   processed and can be scripted to fail, stall, rate-limit or lose their
//!   response after doing the work.
//! * [`TestEnv`] — all of the above plus an engine, in a few lines.
//! * [`Explorer`] — the crash-point explorer: every boundary of a workflow,
//!   crashed and frozen, checked against the invariants by counting.
//! * Failpoints themselves live in [`crate::faults`].

mod consumer;
pub mod database;
mod env;
mod explorer;
mod provider;
mod server;

pub use consumer::{Delivery, FakeConsumer};
pub use env::{wait_until, TestEnv};
pub use explorer::{Explorer, Mode, Report, Row};
pub use provider::{FakeProvider, ProviderRequest};
pub use server::{threads as fake_server_threads, Behaviour};
