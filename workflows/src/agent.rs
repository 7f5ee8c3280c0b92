//! `agent`: the model ↔ tool-call loop.
//!
//! Each turn calls the model (key `job:{id}:turn:{n}`) with the tool
//! definitions. When it answers with `tool_calls`, each call is executed once
//! through the tool ledger (position = turn and index), its result appended as
//! a `tool` message, and the model is called again; when it answers without
//! tool calls, that answer is the result. Past `max_turns` the job is dead.
//! With `"stream": true` every turn is streamed and journaled as it arrives
//! (the final answer is the text watchers see grow); a turn's tool calls are
//! assembled from its stream before any of them runs.
//!
//! With `"approval": ["<tool>", …]` (or `"all"`), a call of such a tool
//! first waits for a person's decision (`ctx.wait_for_approval`, the signal
//! `approval:{tool_call_id}`), holding nothing meanwhile: approved, it runs
//! once through the ledger; refused, or unanswered within
//! `"approval_timeout_s"` (default one day), it never runs and the model is
//! told so in the tool's message, and the agent goes on.

use std::collections::BTreeMap;
use std::sync::Arc;

use onceflow_engine::context::Decision;
use onceflow_engine::error::ErrorEnvelope;
use onceflow_engine::{Context, InvalidInput, StepError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::mcp::{McpServers, PinnedTool};
use crate::tool::Tool;

/// Turns allowed when the input does not say.
pub const DEFAULT_MAX_TURNS: u32 = 8;

/// The step under which an agent job pins its tool definitions
/// (`job:{id}:step:tools`).
pub const TOOLS_STEP: &str = "tools";

/// The step under which an agent job pins the tools its MCP servers listed
/// (`job:{id}:step:mcp-tools`); only a job that asks for MCP servers has it.
pub const MCP_TOOLS_STEP: &str = "mcp-tools";

/// The agent workflow with its tools.
#[derive(Clone, Default)]
pub struct Agent {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    mcp: McpServers,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("tools", &self.tools.keys())
            .field("mcp", &self.mcp)
            .finish()
    }
}

impl Agent {
    /// An agent with no tools yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool given as a shared pointer; panics on a duplicate name.
    pub fn with_shared_tool(mut self, tool: Arc<dyn Tool>) -> Self {
        let name = tool.name().to_owned();
        let previous = self.tools.insert(name.clone(), tool);
        assert!(previous.is_none(), "tool {name:?} registered twice");
        self
    }

    /// Gives the agent the operator's MCP servers: a job names the ones it
    /// uses in its input's `"mcp"`.
    pub fn with_mcp_servers(mut self, servers: McpServers) -> Self {
        self.mcp = servers;
        self
    }

    /// Adds a tool; panics on a duplicate name.
    pub fn with_tool(mut self, tool: impl Tool) -> Self {
        let name = tool.name().to_owned();
        let previous = self.tools.insert(name.clone(), Arc::new(tool));
        assert!(previous.is_none(), "tool {name:?} registered twice");
        self
    }
}

/// `input` of an agent job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentInput {
    /// The model to ask each turn (non-empty).
    pub model: String,
    /// OpenAI chat messages.
    pub messages: Vec<Value>,
    /// Turns allowed, 1 to [`MAX_TURNS`] (default [`DEFAULT_MAX_TURNS`]).
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Which provider answers (default OpenAI).
    #[serde(
        default,
        skip_serializing_if = "crate::completion::ModelProvider::is_default"
    )]
    pub provider: crate::completion::ModelProvider,
    /// Stream every turn's answer: the text of each turn —
    /// the final answer's above all — is journaled as it arrives and shown
    /// on `GET /v1/jobs/{id}/events` under its turn's key; tool calls are
    /// assembled from the stream and run once each, as without it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Tools whose calls wait for a person's approval first: `"all"`, or a
    /// list of tool names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
    /// How long an approval is waited for, in seconds (default one day, at
    /// most [`MAX_APPROVAL_TIMEOUT_S`]); unanswered, the call is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_timeout_s: Option<u64>,
    /// MCP servers (names the operator configured) whose tools the model
    /// is offered, as `mcp__{server}__{tool}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp: Vec<String>,
}

/// Which tool calls wait for a person's approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Approval {
    /// `"all"`: every tool call.
    Every(EveryTool),
    /// The calls of these tools.
    Tools(Vec<String>),
}

/// The words `"all"` and `"destructive"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EveryTool {
    /// Every tool.
    All,
    /// Every tool that does not say it is harmless: an MCP tool not marked
    /// `readOnlyHint: true` or `destructiveHint: false`, and every Rust tool
    /// (which says nothing of itself).
    Destructive,
}

impl Approval {
    /// Whether a call of `tool` waits for a person; `mcp` is the tool as
    /// pinned when it comes from an MCP server.
    fn covers(&self, tool: &str, mcp: Option<&PinnedTool>) -> bool {
        match self {
            Approval::Every(EveryTool::All) => true,
            Approval::Every(EveryTool::Destructive) => {
                mcp.is_none_or(PinnedTool::needs_approval_when_destructive)
            }
            Approval::Tools(names) => names.iter().any(|n| n == tool),
        }
    }

    /// The first listed name that is not among `tools`, with its index: a
    /// misspelt name would otherwise let the tool it meant run unasked.
    fn unknown<'a>(&'a self, tools: &[&str]) -> Option<(usize, &'a str)> {
        self.unknown_where(|name| tools.contains(&name))
    }

    fn unknown_where(&self, known: impl Fn(&str) -> bool) -> Option<(usize, &str)> {
        match self {
            Approval::Every(_) => None,
            Approval::Tools(names) => names
                .iter()
                .enumerate()
                .find(|(_, n)| !known(n))
                .map(|(i, n)| (i, n.as_str())),
        }
    }
}

/// How long an approval is waited for when the input does not say: a day.
pub const DEFAULT_APPROVAL_TIMEOUT_S: u64 = 24 * 3600;

/// Longest approval wait accepted: 30 days.
pub const MAX_APPROVAL_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// The result of an agent job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentOutput {
    /// The final assistant message's text.
    pub content: String,
    /// Model calls made (turns).
    pub turns: u32,
    /// Tool calls executed (or replayed) on the way.
    pub tool_calls: u32,
}

/// Largest `max_turns` accepted: each turn is a paid model call.
pub const MAX_TURNS: u32 = 64;

impl Workflow for Agent {
    const NAME: &'static str = "agent";
    type Input = AgentInput;
    type Output = AgentOutput;

    fn output_schema() -> Option<Value> {
        Some(json!({
            "type": "object",
            "description": "The result of an `agent` job: its final answer.",
            "required": ["content", "turns", "tool_calls"],
            "properties": {
                "content": { "type": "string", "description": "The final assistant message's text." },
                "turns": { "type": "integer", "minimum": 1, "description": "Model calls made (turns)." },
                "tool_calls": { "type": "integer", "minimum": 0, "description": "Tool calls executed (or replayed) on the way." },
            },
        }))
    }

    fn input_schema() -> Option<Value> {
        Some(json!({
            "type": "object",
            "description": "A tool-using conversation: the model is asked turn by turn, each tool call runs once.",
            "required": ["model", "messages"],
            "additionalProperties": false,
            "properties": {
                "model": { "type": "string", "pattern": "\\S",
                    "description": "The model to ask each turn (not blank)." },
                "messages": { "type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "required": ["role"],
                    "properties": { "role": { "type": "string" } },
                    "description": "An OpenAI chat message.",
                } },
                "max_turns": { "type": "integer", "minimum": 1, "maximum": MAX_TURNS,
                    "default": DEFAULT_MAX_TURNS },
                "provider": { "enum": ["openai", "anthropic"], "default": "openai" },
                "stream": { "type": "boolean", "default": false,
                    "description": "Journal every turn's text as it arrives; watch it on GET /v1/jobs/{id}/events." },
                "approval": {
                    "description": "Tool calls that wait for a person's approval (the signal approval:{tool_call_id}) before they run: \"all\"; \"destructive\" (every tool not marked readOnlyHint: true or destructiveHint: false by its MCP server, and every Rust tool); or names of the agent's tools, MCP ones as mcp__{server}__{tool} (a name it does not have is refused).",
                    "oneOf": [
                        { "const": "all" },
                        { "const": "destructive" },
                        { "type": "array", "items": { "type": "string" } },
                    ],
                },
                "approval_timeout_s": { "type": "integer", "minimum": 1,
                    "maximum": MAX_APPROVAL_TIMEOUT_S, "default": DEFAULT_APPROVAL_TIMEOUT_S,
                    "description": "Unanswered this long, the call is refused." },
                "mcp": { "type": "array", "uniqueItems": true, "items": { "type": "string" },
                    "description": "MCP servers of this node (ONCEFLOW_MCP_SERVERS) whose tools the model is offered, as mcp__{server}__{tool}." },
            },
        }))
    }

    fn validate(input: &AgentInput) -> Result<(), InvalidInput> {
        crate::validate_chat(&input.model, input.messages.len())?;
        for (i, m) in input.messages.iter().enumerate() {
            if !m.get("role").is_some_and(Value::is_string) {
                return Err(InvalidInput::new(
                    format!("input.messages[{i}].role"),
                    "is required",
                ));
            }
        }
        if let Some(t) = input.approval_timeout_s {
            if !(1..=MAX_APPROVAL_TIMEOUT_S).contains(&t) {
                return Err(InvalidInput::new(
                    "input.approval_timeout_s",
                    format!("must be between 1 and {MAX_APPROVAL_TIMEOUT_S}"),
                ));
            }
        }
        if let Some(turns) = input.max_turns {
            if !(1..=MAX_TURNS).contains(&turns) {
                return Err(InvalidInput::new(
                    "input.max_turns",
                    format!("must be between 1 and {MAX_TURNS}"),
                ));
            }
        }
        Ok(())
    }

    fn validate_here(&self, input: &AgentInput) -> Result<(), InvalidInput> {
        for (i, server) in input.mcp.iter().enumerate() {
            if self.mcp.get(server).is_none() {
                return Err(InvalidInput::new(
                    format!("input.mcp[{i}]"),
                    format!(
                        "names {server:?}, which is not an MCP server of this node {:?} (ONCEFLOW_MCP_SERVERS)",
                        self.mcp.names()
                    ),
                ));
            }
            if input.mcp[..i].contains(server) {
                return Err(InvalidInput::new(
                    format!("input.mcp[{i}]"),
                    format!("names {server:?} twice"),
                ));
            }
        }
        let tools: Vec<&str> = self.tools.keys().map(String::as_str).collect();
        // An MCP tool is known once its server lists it; here its name
        // must at least name one of the job's servers (the pinned list
        // decides before any tool runs).
        let known = |name: &str| {
            tools.contains(&name)
                || input.mcp.iter().any(|server| {
                    name.strip_prefix(crate::mcp::PREFIX)
                        .and_then(|rest| rest.strip_prefix(server.as_str()))
                        .is_some_and(|rest| rest.len() > 2 && rest.starts_with("__"))
                })
        };
        match input.approval.as_ref().and_then(|a| a.unknown_where(known)) {
            Some((i, name)) => Err(InvalidInput::new(
                format!("input.approval[{i}]"),
                format!("names {name:?}, which is not one of this agent's tools {tools:?} nor a tool of its MCP servers {:?}", input.mcp),
            )),
            None => Ok(()),
        }
    }

    async fn run(&self, ctx: &mut Context, input: AgentInput) -> Result<AgentOutput, StepError> {
        let max_turns = input.max_turns.unwrap_or(DEFAULT_MAX_TURNS);
        // A streamed agent's watchers see its tool calls too.
        ctx.show_tool_calls(input.stream);
        // The tool set is pinned in the journal before the first turn: a job
        // resumed on a node whose tools differ (a deploy half rolled out)
        // asks the model with the same list, so each turn's request keeps
        // its key's hash.
        let here: Vec<Value> = self.tools.values().map(|t| t.definition()).collect();
        let mut definitions: Vec<Value> = ctx.step(TOOLS_STEP, |_| async move { Ok(here) }).await?;
        // An MCP server's tools are listed once and pinned likewise: every
        // node and every resume offers the same list.
        let mcp_tools: Vec<PinnedTool> = if input.mcp.is_empty() {
            Vec::new()
        } else {
            let (servers, wanted, timeout) = (&self.mcp, &input.mcp, ctx.tool_timeout());
            ctx.step(MCP_TOOLS_STEP, |step| async move {
                let how = crate::mcp::Listing {
                    client: &step.client,
                    guard: &step.guard,
                    timeout,
                    response_limit: step.response_limit,
                };
                crate::mcp::list(servers, wanted, how).await
            })
            .await?
        };
        definitions.extend(mcp_tools.iter().map(PinnedTool::definition));
        // Intake checked the approval list against its node's tools; the
        // pinned set decides here, so a name that matches none of them ends
        // the job before any tool can run unasked (fails closed).
        let pinned: Vec<&str> = definitions
            .iter()
            .filter_map(|d| d["function"]["name"].as_str())
            .collect();
        if let Some((i, name)) = input.approval.as_ref().and_then(|a| a.unknown(&pinned)) {
            return Err(StepError::permanent(
                "invalid_input",
                "the approval list names a tool the job does not have",
                format!(
                    "input.approval[{i}] names {name:?}, which is not one of this job's tools {pinned:?}"
                ),
            ));
        }
        let mut messages = input.messages.clone();
        let mut executed = 0;
        // Calls so far under each provider id: an MCP call's key is
        // `…:tool:{id}#{n}` for the n-th under a reused id.
        let mut calls_by_id: BTreeMap<String, usize> = BTreeMap::new();
        for turn in 0..max_turns {
            let mut request = json!({ "model": input.model, "messages": messages });
            if !definitions.is_empty() {
                request["tools"] = json!(definitions);
            }
            input.provider.mark(&mut request);
            if input.stream {
                // Part of the request's identity, as in `completion`.
                request["stream"] = json!(true);
            }
            let response = ctx.generate(&format!("turn:{turn}"), &request).await?;
            let message = response["choices"][0]["message"].clone();
            let calls = message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if calls.is_empty() {
                return Ok(AgentOutput {
                    content: message["content"].as_str().unwrap_or_default().to_owned(),
                    turns: turn + 1,
                    tool_calls: executed,
                });
            }
            messages.push(message);
            for (index, call) in calls.iter().enumerate() {
                let id = call["id"].as_str().unwrap_or_default();
                let name = call["function"]["name"].as_str().unwrap_or_default();
                let raw = call["function"]["arguments"].as_str().unwrap_or("{}");
                let arguments: Value = serde_json::from_str(raw).map_err(|e| {
                    StepError::permanent(
                        "bad_tool_arguments",
                        format!("the model's arguments for {name} ({id}) are not JSON"),
                        e.to_string(),
                    )
                })?;
                let nth = {
                    let n = calls_by_id.entry(id.to_owned()).or_insert(0);
                    *n += 1;
                    *n
                };
                let mcp_tool = mcp_tools.iter().find(|t| t.name() == name);
                if let Some(refused) = approve(ctx, &input, id, name, mcp_tool, &arguments).await? {
                    messages
                        .push(json!({ "role": "tool", "tool_call_id": id, "content": refused }));
                    continue;
                }
                if let Some(pinned) = mcp_tool {
                    let key = crate::mcp::idempotency_key(&ctx.job_key(), id, nth);
                    let result = self
                        .call_mcp(ctx, pinned, (turn, index), id, key, &arguments)
                        .await?;
                    executed += 1;
                    messages.push(json!({ "role": "tool", "tool_call_id": id, "content": result }));
                    continue;
                }
                let tool = match self.tools.get(name) {
                    Some(tool) => tool.clone(),
                    // Pinned for this job, missing on this node: another
                    // node (or this one after its deploy) may run it.
                    None if definitions
                        .iter()
                        .any(|d| d["function"]["name"].as_str() == Some(name)) =>
                    {
                        let error = ErrorEnvelope {
                            code: "tool_unavailable".to_owned(),
                            message: format!(
                                "this job's agent has tool {name:?}, and this node's does not"
                            ),
                            retryable: true,
                        };
                        return Err(ctx.retry(&format!("tool-unavailable:{name}"), error).await);
                    }
                    None => {
                        return Err(StepError::permanent(
                            "unknown_tool",
                            format!("the model called {name:?}, which this agent does not have"),
                            format!("tools: {:?}", self.tools.keys().collect::<Vec<_>>()),
                        ))
                    }
                };
                let result = ctx
                    .tool(
                        turn as i32,
                        index as i32,
                        id,
                        name,
                        &arguments,
                        |invocation| {
                            let arguments = arguments.clone();
                            async move { tool.execute(invocation, arguments).await }
                        },
                    )
                    .await?;
                executed += 1;
                messages.push(json!({ "role": "tool", "tool_call_id": id, "content": result }));
            }
        }
        Err(StepError::permanent(
            "turn_limit",
            format!("the agent did not finish within {max_turns} turns"),
            "the model kept calling tools; raise input.max_turns or fix the prompt",
        ))
    }
}

impl Agent {
    /// One call of a pinned MCP tool, through the tool ledger: run once, or
    /// (a tool that may not run twice, its answer lost) stopped for a
    /// decision.
    async fn call_mcp(
        &self,
        ctx: &mut Context,
        pinned: &PinnedTool,
        (turn, index): (u32, usize),
        id: &str,
        key: String,
        arguments: &Value,
    ) -> Result<String, StepError> {
        let Some(server) = self.mcp.get(&pinned.server).cloned() else {
            // Pinned for this job, unknown to this node's configuration:
            // another node (or this one after its deploy) may have it.
            let error = ErrorEnvelope {
                code: "tool_unavailable".to_owned(),
                message: format!(
                    "this job's agent uses MCP server {:?}, which this node does not have",
                    pinned.server
                ),
                retryable: true,
            };
            let name = format!("mcp-server-unavailable:{}", pinned.server);
            return Err(ctx.retry(&name, error).await);
        };
        let name = pinned.name();
        let call = onceflow_engine::ToolCall {
            turn: turn as i32,
            index: index as i32,
            tool_call_id: id,
            tool_name: &name,
            arguments,
            mode: pinned.mode(),
            server: Some(&pinned.server),
        };
        ctx.tool_call(call, |invocation| {
            let arguments = arguments.clone();
            async move { crate::mcp::call(&server, pinned, arguments, key, invocation).await }
        })
        .await
    }
}

/// When `name`'s calls need approval, waits for it; returns `None` when the
/// call may run, or the tool message that tells the model it was refused.
async fn approve(
    ctx: &mut Context,
    input: &AgentInput,
    id: &str,
    name: &str,
    mcp: Option<&PinnedTool>,
    arguments: &Value,
) -> Result<Option<String>, StepError> {
    if !input.approval.as_ref().is_some_and(|a| a.covers(name, mcp)) {
        return Ok(None);
    }
    let timeout_s = input
        .approval_timeout_s
        .unwrap_or(DEFAULT_APPROVAL_TIMEOUT_S);
    let decision = ctx
        .wait_for_approval(
            id,
            name,
            arguments,
            std::time::Duration::from_secs(timeout_s),
        )
        .await?;
    Ok(match decision {
        Some(Decision { approved: true, .. }) => None,
        Some(Decision { note, .. }) => Some(format!(
            "The call of {name} was refused by a person and did not run.{}",
            note.map(|n| format!(" Their note: {n}"))
                .unwrap_or_default()
        )),
        None => Some(format!(
            "The call of {name} was not approved within {timeout_s} s and did not run."
        )),
    })
}
