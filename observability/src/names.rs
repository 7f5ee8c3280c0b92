//! Every span, attribute and metric name onceflow emits, in one place.
//!
//! Dashboards, alerts and tests refer to these; change one here and it
//! changes everywhere. Metric names are OpenTelemetry names; `/metrics`
//! shows them in Prometheus form (dots become underscores, counters end in
//! `_total`, the duration histogram in `_seconds`).

// ---- spans ------------------------------------------------------------------

/// `POST /v1/jobs`: the intake of a job (server span). The job's attempts are
/// its children, so a job's trace starts here (or at the caller's span).
pub const SPAN_SUBMIT: &str = "submit";
/// One attempt of a job, on one node.
pub const SPAN_JOB: &str = "job";
/// One model call (client span, GenAI attributes).
pub const SPAN_GENERATE: &str = "generate";
/// The commit of the workflow's output (`… → persisted`).
pub const SPAN_PERSIST: &str = "persist";
/// The claim of the completion webhook (`persisted → claimed`).
pub const SPAN_CLAIM: &str = "claim";
/// One send of the completion webhook, or its suppression.
pub const SPAN_DELIVER: &str = "deliver";
/// The final checkpoint (`delivered → acked`).
pub const SPAN_ACK: &str = "ack";
/// One tool call of an agent (client span).
pub const SPAN_TOOL: &str = "tool";
/// One general step of a user workflow (`Context::step`).
pub const SPAN_STEP: &str = "step";
/// A child job started by a workflow (`ctx.spawn`); the child's trace continues from it.
pub const SPAN_SPAWN: &str = "spawn";

// ---- attributes -------------------------------------------------------------

/// The job's id.
pub const JOB_ID: &str = "job.id";
/// The job's workflow name.
pub const WORKFLOW_NAME: &str = "workflow.name";
/// The attempt's number (the job's attempt count).
pub const JOB_ATTEMPT: &str = "job.attempt";
/// The attempt's lease epoch (its fence).
pub const LEASE_EPOCH: &str = "lease.epoch";
/// How an attempt ended: acked, dead, rescheduled, lease_lost, crashed, abandoned.
pub const JOB_OUTCOME: &str = "job.outcome";
/// `from->to`, e.g. `generated->persisted`.
pub const TRANSITION: &str = "onceflow.transition";
/// The idempotency key of the step's side effect (`job:{id}:…`).
pub const IDEMPOTENCY_KEY: &str = "onceflow.idempotency_key";
/// What the step did: see the `OUTCOME_*` values.
pub const OUTCOME: &str = "onceflow.outcome";
/// Set on `persist` and `claim` when both were one commit.
pub const SHARED_COMMIT: &str = "onceflow.shared_commit";
/// A job state (metric attribute).
pub const STATE: &str = "onceflow.state";
/// An API token's name (metric attribute): operator-made, and only tokens
/// with a daily budget carry it, so the series are as many as the
/// budgets set.
pub const TOKEN: &str = "onceflow.token";
/// A step name (metric attribute of the duration histogram).
pub const STEP: &str = "onceflow.step";
/// Whether intake created the job or found it (`created`, `existing`).
pub const SUBMIT_OUTCOME: &str = "onceflow.submit.outcome";
/// On token counts: the tokens came from a request that repeated an earlier
/// send of the same key (what retries cost).
pub const RETRY: &str = "onceflow.retry";
/// A failure's error code (the stored envelope's `code`).
pub const ERROR_CODE: &str = "error.type";
/// The HTTP status of an outgoing request's answer.
pub const HTTP_STATUS: &str = "http.response.status_code";

// GenAI semantic conventions.
/// The GenAI operation of a model call (`chat`).
pub const GEN_AI_OPERATION: &str = "gen_ai.operation.name";
/// The model provider (`openai`: the OpenAI-compatible API).
pub const GEN_AI_PROVIDER: &str = "gen_ai.provider.name";
/// The model the request asked for.
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
/// The model that answered.
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
/// Prompt tokens the provider reported for the call.
pub const GEN_AI_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Completion tokens the provider reported for the call.
pub const GEN_AI_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// Which tokens a token count is (`input`, `output`).
pub const GEN_AI_TOKEN_TYPE: &str = "gen_ai.token.type";
/// The tool an agent called.
pub const GEN_AI_TOOL_NAME: &str = "gen_ai.tool.name";
/// The provider's id of the tool call.
pub const GEN_AI_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";

// ---- outcomes (values of OUTCOME and of metric `outcome` attributes) ---------

/// This attempt did the work (sent the request, committed the checkpoint).
pub const OUTCOME_PERFORMED: &str = "performed";
/// The journal already held the result; nothing was sent.
pub const OUTCOME_REPLAYED: &str = "replayed";
/// A constraint or the lease guard decided another attempt had done it.
pub const OUTCOME_SUPPRESSED: &str = "suppressed";
/// The step failed for good (the job is dead or the attempt stopped).
pub const OUTCOME_FAILED: &str = "failed";
/// The step failed and runs again later, with the same key.
pub const OUTCOME_RETRIED: &str = "retried";
/// The webhook consumer answered 2xx and the delivery is recorded.
pub const OUTCOME_DELIVERED: &str = "delivered";
/// A send was not made because the journal shows it delivered (or closed).
pub const OUTCOME_DUPLICATE_SUPPRESSED: &str = "duplicate_suppressed";
/// The delivery is dead-lettered.
pub const OUTCOME_DEAD: &str = "dead";

// ---- metrics ----------------------------------------------------------------

/// Counter: jobs offered to intake, by `workflow.name` and `onceflow.submit.outcome`.
pub const METRIC_JOBS_SUBMITTED: &str = "onceflow.jobs.submitted";
/// Counter: checkpoints committed, by the state reached (`onceflow.state`).
pub const METRIC_TRANSITIONS: &str = "onceflow.transitions";
/// Counter: model calls by `onceflow.outcome` (performed, replayed, retried, failed).
pub const METRIC_MODEL_CALLS: &str = "onceflow.model.calls";
/// Counter: tokens reported by the provider, by `gen_ai.token.type` and `onceflow.retry`.
pub const METRIC_MODEL_TOKENS: &str = "onceflow.model.tokens";
/// Counter: webhook deliveries by `onceflow.outcome` (delivered, retried, duplicate_suppressed, dead).
pub const METRIC_DELIVERIES: &str = "onceflow.deliveries";
/// Counter: tool executions by `onceflow.outcome` (performed, replayed, retried, failed).
pub const METRIC_TOOL_EXECUTIONS: &str = "onceflow.tool.executions";
/// Counter: MCP tool calls by `onceflow.mcp.server` (a configured name) and
/// `onceflow.outcome` (performed, replayed, retried, failed, unknown).
pub const METRIC_MCP_CALLS: &str = "onceflow.mcp.calls";
/// The configured MCP server a tool call went to (an operator's name:
/// bounded).
pub const MCP_SERVER: &str = "onceflow.mcp.server";
/// Outcome: a call that may not run twice was sent and its answer lost.
pub const OUTCOME_UNKNOWN: &str = "unknown";
/// Counter: jobs this node resumed after another attempt's lease expired.
pub const METRIC_LEASE_TAKEOVERS: &str = "onceflow.lease.takeovers";
/// Up-down counter: job actors running on this node.
pub const METRIC_ACTORS_IN_FLIGHT: &str = "onceflow.actors.in_flight";
/// Gauge: live jobs by `onceflow.state`, and dead jobs (refreshed by the
/// supervisor every ten polls). Acked and cancelled jobs kept for the
/// retention window are not counted: that would read the whole table at every
/// refresh; `onceflow.transitions` counts them as they happen.
pub const METRIC_JOBS: &str = "onceflow.jobs";
/// Live jobs whose workflow is not registered on this node (it never takes them).
pub const METRIC_JOBS_UNRUNNABLE: &str = "onceflow.jobs.unrunnable";
/// Gauge: model tokens a token with a daily budget spent today (UTC), by
/// [`TOKEN`] (read when the metrics are collected).
pub const METRIC_BUDGET_SPENT: &str = "onceflow.budget.spent";
/// Gauge: a token's daily budget of model tokens, by [`TOKEN`].
pub const METRIC_BUDGET_LIMIT: &str = "onceflow.budget.limit";
/// Counter: model requests a provider answered 429, by provider and model.
pub const METRIC_PROVIDER_THROTTLED: &str = "onceflow.provider.throttled";
/// Histogram: seconds a model call waited for a provider limit's slot, by provider and model.
pub const METRIC_LIMIT_WAIT: &str = "onceflow.limit.wait";
/// Gauge: the share (0..=1) of a provider limit in use at the last admission
/// (1 while calls wait), by provider and model.
pub const METRIC_LIMIT_SATURATION: &str = "onceflow.limit.saturation";
/// Histogram (seconds): from a streamed model call's send to its first token.
pub const METRIC_STREAM_TTFT: &str = "onceflow.stream.time_to_first_token";
/// Histogram: output tokens per second of a streamed answer, after its first token.
pub const METRIC_STREAM_TOKENS_PER_SECOND: &str = "onceflow.stream.tokens_per_second";
/// Span attribute: chunks of a streamed answer journaled by this call.
pub const STREAM_CHUNKS: &str = "onceflow.stream.chunks";
/// Histogram (seconds): step duration by `onceflow.step` and `onceflow.outcome`.
pub const METRIC_STEP_DURATION: &str = "onceflow.step.duration";
