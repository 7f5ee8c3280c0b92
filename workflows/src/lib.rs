//! # onceflow-workflows
//!
//! Workflow definitions in Rust. A workflow is a type implementing
//! [`onceflow_engine::Workflow`]: a durable `NAME`, a typed input and output,
//! and a body whose side effects all go through the durable context.
//!
//! * [`completion`] — the built-in six-state job: one model call, its answer
//!   persisted and delivered by webhook.
//!
//! [`registry`] returns every built-in workflow, registered by name.

pub mod completion;

use onceflow_engine::Registry;

pub use completion::Completion;

/// The built-in workflows.
pub fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.register(Completion::default());
    registry
}
