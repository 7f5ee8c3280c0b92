//! Agent tools from MCP servers (the Model Context Protocol, streamable
//! HTTP), through the protocol's own Rust SDK, `rmcp`.
//!
//! An operator names the servers ([`McpServers`], `ONCEFLOW_MCP_SERVERS`); an
//! agent job asks for some of them (`"mcp": ["<server>", …]`). The job lists
//! each server's tools once and pins them in its journal ([`PinnedTool`]),
//! so every node and every resume offers the model the same list, under the
//! names `mcp__{server}__{tool}`. Each `tools/call` goes through the tool
//! ledger like any tool, and carries the job's key in
//! `params._meta["io.onceflow/idempotency-key"]`.
//!
//! What a lost answer does depends on what the tool says of itself
//! ([`PinnedTool::mode`]): a tool marked `readOnlyHint` or `idempotentHint`
//! is called again under the same key; any other one is not, and the job
//! ends `dead` with `tool_outcome_unknown` for a person to decide.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use onceflow_engine::context::TOOL_OUTCOME_UNKNOWN;
use onceflow_engine::error::ErrorEnvelope;
use onceflow_engine::rules::keys::JobKey;
use onceflow_engine::{SendMode, StepError, ToolInvocation, UrlGuard};
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, RequestMetaObject};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ServiceError, ServiceExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The `_meta` key under which every `tools/call` carries its idempotency key.
pub const IDEMPOTENCY_META: &str = "io.onceflow/idempotency-key";

/// The prefix of an MCP tool's name as the model sees it.
pub const PREFIX: &str = "mcp__";

/// The MCP servers an operator configured, by name.
#[derive(Clone, Default)]
pub struct McpServers {
    servers: BTreeMap<String, McpServer>,
}

/// One configured MCP server: its streamable HTTP endpoint and the headers
/// sent with every request (values are secrets: never shown).
#[derive(Clone)]
pub struct McpServer {
    url: url::Url,
    headers: HashMap<reqwest::header::HeaderName, reqwest::header::HeaderValue>,
}

impl std::fmt::Debug for McpServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.servers.iter().map(|(name, s)| (name, s.shown())))
            .finish()
    }
}

impl McpServer {
    /// The URL as it may be shown: scheme, host, port and path (no user,
    /// password or query, which may carry a key).
    fn shown(&self) -> String {
        let u = &self.url;
        let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
        format!(
            "{}://{}{port}{}",
            u.scheme(),
            u.host_str().unwrap_or(""),
            u.path()
        )
    }
}

/// A server's configuration as written (`ONCEFLOW_MCP_SERVERS`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServerSetting {
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, HeaderSetting>,
}

/// A header's value: given as is, or read from the environment or a file
/// (the way to give a secret).
#[derive(Deserialize)]
#[serde(untagged)]
enum HeaderSetting {
    Literal(String),
    Env { env: String },
    File { file: std::path::PathBuf },
}

impl McpServers {
    /// No server.
    pub fn none() -> Self {
        Self::default()
    }

    /// Parses `ONCEFLOW_MCP_SERVERS`: JSON, or `@path` to a JSON file, of
    /// `{"<server>": {"url": "http(s)://…", "headers"?: {"<name>": "<value>"
    /// | {"env": "<VAR>"} | {"file": "<path>"}}}}`. Server names are
    /// letters, digits, `-` and `_` (no `__`), at most 32 characters. Errors
    /// name the server and field, never a header's value.
    pub fn from_setting(setting: &str) -> Result<Self, String> {
        let text = match setting.strip_prefix('@') {
            Some(path) => {
                std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?
            }
            None => setting.to_owned(),
        };
        // Not serde's message: it quotes the value it met, which may be a
        // header's secret.
        let parsed: BTreeMap<String, ServerSetting> = serde_json::from_str(&text).map_err(|e| {
            format!(
                "not a JSON object of servers, each {{\"url\", \"headers\"?}} \
                     (line {}, column {}: {:?} error)",
                e.line(),
                e.column(),
                e.classify()
            )
        })?;
        let mut servers = BTreeMap::new();
        for (name, setting) in parsed {
            let valid_name = !name.is_empty()
                && name.len() <= 32
                && !name.contains("__")
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !valid_name {
                return Err(format!(
                    "server name {name:?}: use 1 to 32 letters, digits, '-' or '_' (no \"__\")"
                ));
            }
            let url = url::Url::parse(&setting.url)
                .ok()
                .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
                .ok_or_else(|| format!("{name}.url: must be an absolute http(s) URL"))?;
            let mut headers = HashMap::new();
            for (header, value) in setting.headers {
                let value = match value {
                    HeaderSetting::Literal(v) => v,
                    HeaderSetting::Env { env } => std::env::var(&env).map_err(|_| {
                        format!("{name}.headers.{header}: environment variable {env} is not set")
                    })?,
                    HeaderSetting::File { file } => std::fs::read_to_string(&file)
                        .map_err(|e| {
                            format!("{name}.headers.{header}: reading {}: {e}", file.display())
                        })?
                        .trim_end_matches(['\r', '\n'])
                        .to_owned(),
                };
                let header_name = reqwest::header::HeaderName::from_bytes(header.as_bytes())
                    .map_err(|_| format!("{name}.headers: {header:?} is not a header name"))?;
                let mut header_value = reqwest::header::HeaderValue::from_str(&value)
                    .map_err(|_| format!("{name}.headers.{header}: not a valid header value"))?;
                header_value.set_sensitive(true);
                headers.insert(header_name, header_value);
            }
            servers.insert(name, McpServer { url, headers });
        }
        Ok(McpServers { servers })
    }

    /// Checks every server's URL against the node's guard (as a webhook's):
    /// a private address needs `ONCEFLOW_ALLOW_PRIVATE_URLS`.
    pub fn check(&self, guard: &UrlGuard) -> Result<(), String> {
        for (name, server) in &self.servers {
            guard
                .check(&server.url)
                .map_err(|refused| format!("{name}.url: {refused}"))?;
        }
        Ok(())
    }

    /// The configured server names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.servers.keys().map(String::as_str).collect()
    }

    /// The server named `name`.
    pub fn get(&self, name: &str) -> Option<&McpServer> {
        self.servers.get(name)
    }

    /// Whether no server is configured.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }
}

/// An MCP tool as a job pinned it: what the model is offered, and what the
/// tool says of itself (its annotations decide a lost answer's fate and
/// whether `"approval": "destructive"` asks a person first).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PinnedTool {
    /// The configured server's name.
    pub server: String,
    /// The tool's name on that server.
    pub tool: String,
    /// What the tool does, for the model.
    pub description: String,
    /// The JSON schema of its arguments.
    pub parameters: Value,
    /// `readOnlyHint`: it changes nothing.
    pub read_only: bool,
    /// `idempotentHint`: calling it twice does what calling it once does.
    pub idempotent: bool,
    /// `destructiveHint` (true when the tool does not say).
    pub destructive: bool,
}

impl PinnedTool {
    /// `mcp__{server}__{tool}`: the name the model calls.
    pub fn name(&self) -> String {
        format!("{PREFIX}{}__{}", self.server, self.tool)
    }

    /// The OpenAI `tools` entry the model is offered.
    pub fn definition(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name(),
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }

    /// A lost answer is sent again only for a tool that is read-only or
    /// idempotent by its own account.
    pub fn mode(&self) -> SendMode {
        if self.read_only || self.idempotent {
            SendMode::AtLeastOnce
        } else {
            SendMode::AtMostOnce
        }
    }

    /// Whether `"approval": "destructive"` asks a person before it runs:
    /// every tool not marked `readOnlyHint: true` or `destructiveHint: false`.
    pub fn needs_approval_when_destructive(&self) -> bool {
        !self.read_only && self.destructive
    }
}

/// Why a server could not be reached for a job that needs it: retried
/// like any transient failure, then the job ends with this code.
const UNAVAILABLE: &str = "mcp_unavailable";

/// Most tools one server may list for a job.
pub const MAX_TOOLS_PER_SERVER: usize = 128;

/// Most bytes of tool definitions a job pins (they go to the model on
/// every turn).
pub const MAX_DEFINITION_BYTES: usize = 1 << 20;

/// A retryable `mcp_unavailable`, counted against a retry budget by the
/// engine: the listing's step's, or the tool ledger's for a call.
/// The message is fixed: the transport's own text names the URL (and may
/// quote the server's answer), which are the operator's, not the job
/// owner's; it goes to the node's log instead.
fn unavailable(server: &str, what: &str) -> StepError {
    StepError::Retry {
        error: ErrorEnvelope {
            code: UNAVAILABLE.to_owned(),
            message: format!("MCP server {server:?} could not be reached ({what})"),
            retryable: true,
        },
        attempt: 1,
        retry_after: None,
    }
}

/// What one connection may hold of a server's answer: the node's bound,
/// plus room for the JSON-RPC envelope around it.
fn transport_limit(response_limit: usize) -> usize {
    response_limit.saturating_mul(2).saturating_add(64 << 10)
}

async fn connect(
    name: &str,
    server: &McpServer,
    client: reqwest::Client,
    guard: &UrlGuard,
    response_limit: usize,
) -> Result<RunningService<RoleClient, ()>, StepError> {
    // A name is resolved through the guard by the client; an address
    // literal is checked here.
    guard.check(&server.url).map_err(|refused| {
        tracing::warn!(server = name, url = %server.shown(), %refused, "an MCP server's URL is refused");
        StepError::permanent(
            "url_refused",
            format!("MCP server {name:?}'s URL is refused by this node's guard"),
            "the operator's configuration names a private address (see the node's log)",
        )
    })?;
    let limit = transport_limit(response_limit);
    let config = StreamableHttpClientTransportConfig::with_uri(server.url.as_str())
        .custom_headers(server.headers.clone())
        .max_json_response_size(limit)
        .max_sse_event_size(limit)
        // The ledger alone decides whether a call is sent again.
        .reinit_on_expired_session(false);
    let transport = StreamableHttpClientTransport::with_client(client, config);
    ().serve(transport).await.map_err(|e| {
        tracing::warn!(server = name, url = %server.shown(), error = %e, "could not open an MCP session");
        unavailable(name, "no session")
    })
}

/// Closes a session without waiting for it: the answer is in hand.
fn close(service: RunningService<RoleClient, ()>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(5), service.cancel()).await;
    });
}

/// How a job lists its servers' tools.
#[derive(Debug, Clone)]
pub struct Listing<'a> {
    /// The guarded client.
    pub client: &'a reqwest::Client,
    /// The node's URL guard.
    pub guard: &'a UrlGuard,
    /// How long one server's listing may take.
    pub timeout: Duration,
    /// Largest answer read.
    pub response_limit: usize,
}

/// Whether `name` may be offered to a model: OpenAI's and Anthropic's
/// function names are `^[a-zA-Z0-9_-]{1,64}$`.
fn offerable(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Lists `servers`' tools (`tools/list`, every page), in the order given,
/// each within the listing's timeout. A server this node does not have, or
/// one that cannot be reached, is a retryable `mcp_unavailable`, until the
/// job's retry budget is spent. A tool whose name a model cannot be
/// offered (`mcp__{server}__{tool}` past 64 characters, or other than
/// letters, digits, `_` and `-`) is left out, and logged; more than
/// [`MAX_TOOLS_PER_SERVER`] tools, or definitions past
/// [`MAX_DEFINITION_BYTES`], end the job (`mcp_tools_too_large`).
pub async fn list(
    servers: &McpServers,
    wanted: &[String],
    how: Listing<'_>,
) -> Result<Vec<PinnedTool>, StepError> {
    let Listing {
        client,
        guard,
        timeout,
        response_limit,
    } = how;
    let mut pinned = Vec::new();
    for name in wanted {
        let Some(server) = servers.get(name) else {
            return Err(unavailable(name, "this node has no such server"));
        };
        let listed = tokio::time::timeout(timeout, async {
            let limit = response_limit.max(MAX_DEFINITION_BYTES);
            let service = connect(name, server, client.clone(), guard, limit).await?;
            let tools = service.peer().list_all_tools().await.map_err(|e| {
                tracing::warn!(server = name.as_str(), error = %e, "tools/list failed");
                unavailable(name, "tools/list failed")
            });
            close(service);
            tools
        })
        .await
        .map_err(|_| unavailable(name, "tools/list took too long"))??;
        if listed.len() > MAX_TOOLS_PER_SERVER {
            return Err(too_large(name, format!("{} tools", listed.len())));
        }
        for tool in listed {
            let hints = tool.annotations.as_ref();
            let one = PinnedTool {
                server: name.clone(),
                tool: tool.name.to_string(),
                description: tool.description.as_deref().unwrap_or_default().to_owned(),
                parameters: Value::Object((*tool.input_schema).clone()),
                read_only: hints.and_then(|h| h.read_only_hint).unwrap_or(false),
                idempotent: hints.and_then(|h| h.idempotent_hint).unwrap_or(false),
                destructive: hints.and_then(|h| h.destructive_hint).unwrap_or(true),
            };
            if !offerable(&one.name()) {
                tracing::warn!(server = name.as_str(), tool = %one.tool, "an MCP tool whose name a model cannot be offered is left out");
                continue;
            }
            pinned.push(one);
        }
    }
    let bytes = serde_json::to_vec(&pinned).map_or(0, |b| b.len());
    if bytes > MAX_DEFINITION_BYTES {
        return Err(too_large(
            &wanted.join(","),
            format!("{bytes} bytes of definitions"),
        ));
    }
    Ok(pinned)
}

fn too_large(server: &str, what: String) -> StepError {
    StepError::permanent(
        "mcp_tools_too_large",
        format!("MCP server {server:?} lists more tools than a job takes"),
        format!("{what}; at most {MAX_TOOLS_PER_SERVER} tools per server and {MAX_DEFINITION_BYTES} bytes of definitions"),
    )
}

/// `job:{id}:tool:{tool_call_id}` (`job:{id}#{n}:…` for a later
/// incarnation of the id), or `…#{n}` for the `n`-th call in the
/// conversation under an id the provider used before (as a wait's key):
/// the key every `tools/call` of this call carries in `params._meta`, the
/// same on every attempt. A `#` or `%` in the provider's id is escaped
/// (`%23`, `%25`), so no id's key is another call's.
pub fn idempotency_key(job: &JobKey, tool_call_id: &str, nth: usize) -> String {
    let id = tool_call_id.replace('%', "%25").replace('#', "%23");
    let job = job.as_str();
    match nth {
        0 | 1 => format!("{job}:tool:{id}"),
        n => format!("{job}:tool:{id}#{n}"),
    }
}

/// Calls `tool` on `server` once (`tools/call` with `key` in `_meta`);
/// returns what the model reads. A tool's own error (`isError: true`), or
/// a refusal of the request itself (JSON-RPC invalid request or params,
/// no such method), is a result the model reads — unless a fresh
/// `tools/list` shows the server no longer has the tool: then it is
/// `tool_unavailable`, retried (nothing ran). A tool that may not run
/// twice is never retried on its own error (it may have run partway): its
/// server is asked whether it still lists the tool before the call is
/// sent (`tool_unavailable`, nothing sent), and its error answer is what
/// the model reads. A server that cannot be reached before the call is
/// sent is retried. A call sent whose answer is lost (a dropped
/// connection, an internal error, past the node's tool timeout, counted
/// from before the session opens) is retried under the same key for a
/// read-only or idempotent tool and is `tool_outcome_unknown` for any
/// other. An answer over the node's bound is a result saying so.
pub async fn call(
    server: &McpServer,
    tool: &PinnedTool,
    arguments: Value,
    key: String,
    invocation: ToolInvocation,
) -> Result<String, StepError> {
    let name = &tool.server;
    let arguments = match arguments {
        Value::Object(map) => map,
        other => {
            return Ok(format!(
                "The call of {} was not sent: its arguments must be a JSON object, not {}.",
                tool.name(),
                json_kind(&other)
            ))
        }
    };
    let deadline = tokio::time::Instant::now() + invocation.timeout;
    let mut meta = RequestMetaObject::new();
    meta.insert(IDEMPOTENCY_META.to_owned(), json!(key));
    let mut params = CallToolRequestParams::new(tool.tool.clone()).with_arguments(arguments);
    params.meta = Some(meta);
    let service = tokio::time::timeout_at(
        deadline,
        connect(
            name,
            server,
            invocation.client.clone(),
            &invocation.guard,
            invocation.response_limit,
        ),
    )
    .await
    .map_err(|_| unavailable(name, "no session in time"))??;
    if tool.mode() == SendMode::AtMostOnce {
        // A tool that may not run twice is never retried on its own error
        // (it may have run partway), so whether the server still has it is
        // asked before the call, while nothing has been sent.
        match still_listed(&service, tool, deadline).await {
            Some(true) => {}
            Some(false) => {
                close(service);
                return Err(withdrawn(tool));
            }
            None => {
                close(service);
                return Err(unavailable(name, "tools/list failed before the call"));
            }
        }
    }
    // From here the call may reach the server.
    let answered = tokio::time::timeout_at(deadline, service.peer().call_tool(params)).await;
    let read = match answered {
        Ok(Ok(result)) if result.is_error != Some(true) => {
            Ok(read_result(tool, &result, invocation.response_limit))
        }
        // A tool that may not run twice and answered with an error may
        // have run partway: the model reads it, it is never sent again.
        Ok(Ok(result)) if tool.mode() == SendMode::AtMostOnce => {
            Ok(read_result(tool, &result, invocation.response_limit))
        }
        Ok(Ok(result)) => {
            let text = read_result(tool, &result, invocation.response_limit);
            gone_or(&service, tool, deadline, text).await
        }
        Ok(Err(ServiceError::McpError(refused)))
            if [-32600, -32601, -32602, -32700].contains(&refused.code.0) =>
        {
            let text = format!("The server refused the call: {}", refused.message);
            gone_or(&service, tool, deadline, text).await
        }
        Ok(Err(lost)) => {
            tracing::warn!(server = name.as_str(), tool = %tool.tool, error = %lost, "an MCP call's answer was lost");
            Err(answer_lost(tool, "the session failed before the answer"))
        }
        Err(_) => Err(answer_lost(
            tool,
            "no answer within the node's tool timeout",
        )),
    };
    close(service);
    read
}

/// A retryable `tool_unavailable`: the server no longer lists the tool
/// (nothing ran; a node whose server has it may run it).
fn withdrawn(tool: &PinnedTool) -> StepError {
    StepError::Retry {
        error: ErrorEnvelope {
            code: "tool_unavailable".to_owned(),
            message: format!(
                "MCP server {:?} no longer has tool {:?}",
                tool.server, tool.tool
            ),
            retryable: true,
        },
        attempt: 1,
        retry_after: None,
    }
}

/// An error answer is what the model reads, unless the server no longer
/// lists the tool: then no node can run it here (`tool_unavailable`).
async fn gone_or(
    service: &RunningService<RoleClient, ()>,
    tool: &PinnedTool,
    deadline: tokio::time::Instant,
    text: String,
) -> Result<String, StepError> {
    match still_listed(service, tool, deadline).await {
        Some(false) => Err(withdrawn(tool)),
        _ => Ok(text),
    }
}

/// Whether the server lists `tool` now (a fresh `tools/list` within the
/// call's deadline); `None` when it could not say.
async fn still_listed(
    service: &RunningService<RoleClient, ()>,
    tool: &PinnedTool,
    deadline: tokio::time::Instant,
) -> Option<bool> {
    match tokio::time::timeout_at(deadline, service.peer().list_all_tools()).await {
        Ok(Ok(tools)) => Some(tools.iter().any(|t| t.name == tool.tool)),
        Ok(Err(e)) => {
            tracing::warn!(server = tool.server.as_str(), error = %e, "tools/list failed");
            None
        }
        Err(_) => None,
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A call sent whose answer never came.
fn answer_lost(tool: &PinnedTool, what: &str) -> StepError {
    match tool.mode() {
        SendMode::AtLeastOnce => StepError::Retry {
            error: ErrorEnvelope {
                code: "mcp_call_failed".to_owned(),
                message: format!("the call of {} got no answer ({what})", tool.name()),
                retryable: true,
            },
            attempt: 1,
            retry_after: None,
        },
        SendMode::AtMostOnce => StepError::permanent(
            TOOL_OUTCOME_UNKNOWN,
            format!("the call of {} got no answer ({what})", tool.name()),
            "it may have run",
        ),
    }
}

/// The text the model reads of a tool's result: its text blocks, other
/// blocks as JSON, the structured result when there is nothing else; a
/// tool's error says so. An answer past `limit` bytes is not kept: the
/// model reads that it was too large (the call ran: it is done, never
/// sent again). A NUL character, which the ledger cannot store, is
/// replaced.
fn read_result(tool: &PinnedTool, result: &CallToolResult, limit: usize) -> String {
    let mut parts: Vec<String> = result
        .content
        .iter()
        .map(|block| match block {
            ContentBlock::Text(text) => text.text.clone(),
            other => serde_json::to_string(other).unwrap_or_default(),
        })
        .collect();
    if parts.is_empty() {
        if let Some(structured) = &result.structured_content {
            parts.push(structured.to_string());
        }
    }
    let mut text = parts.join("\n").replace('\0', "\u{FFFD}");
    if result.is_error == Some(true) {
        text = format!("The tool reported an error: {text}");
    }
    if text.len() > limit {
        return format!(
            "The call of {} ran, and its answer of {} bytes is over this node's bound of {limit} bytes: it was not kept.",
            tool.name(),
            text.len()
        );
    }
    text
}
