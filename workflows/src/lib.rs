//! # onceflow-workflows
//!
//! Workflow definitions in Rust. A workflow is a type implementing
//! [`onceflow_engine::Workflow`]: a durable `NAME`, a typed input and output,
//! and a body whose side effects all go through the durable context.
//!
//! * [`completion`] — the built-in six-state job: one model call, its answer
//!   persisted and delivered by webhook.
//! * [`agent`] — the model ↔ tool-call loop; each tool call runs once
//!   through the tool ledger.
//! * [`tool`] — the [`Tool`] trait and the built-in [`HttpPost`] tool.
//! * [`mcp`] — tools from MCP servers, pinned per job, each call run once
//!   or stopped for a decision.
//! * [`example`] — a user's own workflow (a general step) and tool, as a model
//!   to copy.
//!
//! [`registry`] returns the built-in workflows, registered by name.

#![warn(missing_docs)]

pub mod agent;
pub mod completion;
pub mod example;
pub mod mcp;
pub mod tool;

use onceflow_engine::Registry;

pub use agent::Agent;
pub use completion::Completion;
pub use tool::{HttpPost, Tool};

/// The built-in workflows: `completion`, and `agent` with the `http_post`
/// tool when `tool_post_url` is given.
pub fn registry_with(tool_post_url: Option<&str>) -> Registry {
    registry_with_tools(tool_post_url, &[])
}

/// As [`registry_with`], with `tools` given to the agent beside `http_post`.
pub fn registry_with_tools(
    tool_post_url: Option<&str>,
    tools: &[std::sync::Arc<dyn Tool>],
) -> Registry {
    registry_with_mcp(tool_post_url, tools, mcp::McpServers::none())
}

/// As [`registry_with_tools`], with the operator's MCP servers, which an
/// agent job names in its input's `"mcp"`.
pub fn registry_with_mcp(
    tool_post_url: Option<&str>,
    tools: &[std::sync::Arc<dyn Tool>],
    mcp: mcp::McpServers,
) -> Registry {
    let mut registry = Registry::new();
    registry.register(Completion::default());
    let mut agent = Agent::new().with_mcp_servers(mcp);
    if let Some(url) = tool_post_url {
        agent = agent.with_tool(HttpPost::new(url));
    }
    for tool in tools {
        agent = agent.with_shared_tool(tool.clone());
    }
    registry.register(agent);
    registry
}

/// The checks every chat input shares: a model name and at least one message.
pub(crate) fn validate_chat(
    model: &str,
    messages: usize,
) -> Result<(), onceflow_engine::InvalidInput> {
    use onceflow_engine::InvalidInput;
    if model.trim().is_empty() {
        return Err(InvalidInput::new("input.model", "must not be empty"));
    }
    if messages == 0 {
        return Err(InvalidInput::new(
            "input.messages",
            "must hold at least one message",
        ));
    }
    Ok(())
}

/// The built-in workflows, with no tool configured.
pub fn registry() -> Registry {
    registry_with(None)
}
