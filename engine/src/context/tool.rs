//! `ctx.tool`: a tool call executed at most once per position (turn and
//! index), recorded in the tool ledger; `post_json` is a tool's HTTP helper.

use std::time::Duration;

use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::Value;

use super::Context;
use crate::error::StepError;
use crate::net::outbound::PostError;
use crate::request::canonical_hash;
use crate::rules::keys;
pub use crate::rules::verdict::SendMode;
use crate::rules::verdict::{on_call_failure, on_tool_error};
use crate::store::ledger::ToolFailure;

/// What a tool's execution gets: who asked, and the key to pass on.
#[derive(Debug, Clone)]
pub struct ToolInvocation {
    /// The job whose model asked for the tool call.
    pub job_id: String,
    /// The provider's id of this call (recorded, not trusted to be unique).
    pub tool_call_id: String,
    /// `job:{id}:tool:{turn}:{index}`: send it with the tool's own outbound
    /// request so the receiver can drop a repeat.
    pub idempotency_key: String,
    /// The guarded client (no redirects; names resolved through the guard).
    pub client: reqwest::Client,
    /// How long the tool's outbound request may take (the node's webhook timeout).
    pub timeout: Duration,
    /// The job's W3C trace context, to send along (`traceparent`).
    pub traceparent: String,
    /// The SSRF guard: the model chooses a tool's arguments, so whatever URL
    /// a tool posts to is checked like a caller's `webhook_url`.
    pub guard: crate::net::guard::UrlGuard,
    /// Largest answer [`post_json`](Self::post_json) reads; more is
    /// `response_too_large`.
    pub response_limit: usize,
}

impl ToolInvocation {
    /// POSTs `body` as JSON to `url` with this call's `Idempotency-Key`;
    /// returns the response body as text. 408, 429, 5xx and network errors
    /// are retryable, other statuses permanent.
    pub async fn post_json(&self, url: &str, body: &Value) -> Result<String, StepError> {
        let request = crate::net::outbound::Post {
            url,
            headers: vec![
                ("idempotency-key", self.idempotency_key.clone()),
                ("tool-call-id", self.tool_call_id.clone()),
                ("traceparent", self.traceparent.clone()),
            ],
            body: serde_json::to_vec(body).expect("a JSON value serialises"),
            timeout: self.timeout,
            read: crate::net::outbound::Read::Body {
                limit: self.response_limit,
            },
            guard: Some(&self.guard),
        };
        match crate::net::outbound::post(&self.client, request, None).await {
            Ok((_, bytes)) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            Err(PostError::Injected(i)) => Err(i.into()),
            Err(PostError::Failed(f)) => match on_call_failure(&f) {
                verdict if verdict.retries() => Err(StepError::Retry {
                    error: f.envelope(),
                    attempt: 1,
                    retry_after: verdict.retry_after(),
                }),
                _ => Err(StepError::Permanent {
                    // The URL stays out: the job's owner reads the reason, and
                    // the operator's tool URL may carry a key in its query.
                    reason: "the tool's request was refused".to_owned(),
                    error: f.envelope(),
                }),
            },
        }
    }
}

/// One tool call as the model asked for it, and how a lost answer is
/// treated (see [`Context::tool_call`]).
#[derive(Debug, Clone, Copy)]
pub struct ToolCall<'a> {
    /// The model turn that asked for it (0-based).
    pub turn: i32,
    /// Its place among that turn's calls (0-based).
    pub index: i32,
    /// The provider's id of the call.
    pub tool_call_id: &'a str,
    /// The tool's name.
    pub tool_name: &'a str,
    /// The arguments the model gave.
    pub arguments: &'a Value,
    /// Sent again after a lost answer ([`SendMode::AtLeastOnce`]), or never
    /// without a person's decision ([`SendMode::AtMostOnce`]).
    pub mode: SendMode,
    /// The MCP server it goes to, if any: its span says so, and
    /// `onceflow.mcp.calls` counts it by server.
    pub server: Option<&'a str>,
}

/// The error code of a call that was sent and whose answer was lost, when
/// it may not be sent twice.
pub const TOOL_OUTCOME_UNKNOWN: &str = "tool_outcome_unknown";

/// A tool event's phases, as the row's offset (one row per phase and
/// attempt).
const STARTED: (i32, &str) = (0, "started");
const FINISHED: (i32, &str) = (1, "finished");
const FAILED: (i32, &str) = (1, "failed");
const REPLAYED: (i32, &str) = (2, "replayed");

impl Context {
    /// Shows this job's tool calls on its event stream
    /// (`GET /v1/jobs/{id}/events`): a `tool` event when a call starts,
    /// when it finishes or fails, and when a rerun takes its journaled
    /// result without running it again. A streamed agent turns it on.
    pub fn show_tool_calls(&mut self, on: bool) {
        self.tool_events = on;
    }

    /// Journals one tool event (fenced, announced to watchers) when they
    /// are shown; a lost lease stops the call.
    async fn tool_event(
        &self,
        key: &str,
        (offset, phase): (i32, &str),
        name: &str,
        tool_call_id: &str,
    ) -> Result<(), StepError> {
        if !self.tool_events {
            return Ok(());
        }
        let text =
            serde_json::json!({ "phase": phase, "name": name, "tool_call_id": tool_call_id });
        let row = crate::store::streams::StreamRow {
            offset,
            kind: "tool",
            text: text.to_string(),
        };
        self.journal_stream(key, self.fence.attempt.max(1), vec![row])
            .await
    }

    /// Executes a tool call at most once per position (`turn`, `index`) in
    /// the conversation: recorded before `execute` runs, its result stored
    /// after; a replay returns the stored result byte for byte. The same
    /// position with another tool-call id or other arguments is a permanent
    /// error and nothing is executed.
    ///
    /// A call whose answer was lost (the worker died mid-call) is executed
    /// again under the same key; see [`tool_call`](Self::tool_call) for a
    /// tool that may not run twice.
    pub async fn tool<F, Fut>(
        &mut self,
        turn: i32,
        index: i32,
        tool_call_id: &str,
        tool_name: &str,
        arguments: &Value,
        execute: F,
    ) -> Result<String, StepError>
    where
        F: FnOnce(ToolInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<String, StepError>>,
    {
        let call = ToolCall {
            turn,
            index,
            tool_call_id,
            tool_name,
            arguments,
            mode: SendMode::AtLeastOnce,
            server: None,
        };
        self.tool_call(call, execute).await
    }

    /// As [`tool`](Self::tool), with the call's [`SendMode`]: under
    /// [`SendMode::AtMostOnce`] a call that was sent and whose answer was
    /// never recorded is not sent again; the job ends `dead` with
    /// `tool_outcome_unknown` (its ledger row `unknown`), and only a redrive
    /// with `confirm_unknown=true` sends it again, under the same key. An
    /// `execute` that returns the error code `tool_outcome_unknown` (its
    /// request went out and no answer came) records the same.
    pub async fn tool_call<F, Fut>(
        &mut self,
        call: ToolCall<'_>,
        execute: F,
    ) -> Result<String, StepError>
    where
        F: FnOnce(ToolInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<String, StepError>>,
    {
        use crate::store::ledger::{Position, ToolCallSpec};
        let ToolCall {
            turn,
            index,
            tool_call_id,
            tool_name,
            arguments,
            mode,
            server,
        } = call;
        let position = Position { turn, index };
        let hash = canonical_hash(arguments);
        let spec = ToolCallSpec {
            position,
            tool_call_id,
            tool_name,
            arguments,
            arguments_hash: &hash,
            mode,
            server,
        };
        if crate::rules::payload::contains_nul(arguments) {
            return Err(StepError::permanent(
                "invalid_tool_call",
                format!(
                    "tool call {tool_call_id} at turn {turn}, index {index} cannot be journaled"
                ),
                "its arguments contain a NUL character (\\u0000); nothing was executed",
            ));
        }
        let in_flight_ms = (self.tool_timeout + Duration::from_secs(5)).as_millis() as i64;
        let key = keys::tool(&self.fence.key(), turn, index);
        self.follow_journal(&format!("tool:{turn}:{index}"), &key, false)
            .await?;
        let mut attributes = vec![
            KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
            // The GenAI semantic conventions' name for a tool's execution.
            KeyValue::new(GEN_AI_OPERATION, "execute_tool"),
            KeyValue::new(GEN_AI_TOOL_NAME, tool_name.to_owned()),
            KeyValue::new(GEN_AI_TOOL_CALL_ID, tool_call_id.to_owned()),
        ];
        if let Some(server) = server {
            attributes.push(KeyValue::new(MCP_SERVER, server.to_owned()));
        }
        let span = self.scope.step(SPAN_TOOL, SpanKind::Client, attributes);
        let (attempt, span) = match self.admit_tool(&spec, &key, in_flight_ms, span).await? {
            Ok(admitted) => admitted,
            Err(replayed) => return Ok(replayed),
        };
        self.tool_event(&key, STARTED, tool_name, tool_call_id)
            .await?;
        let invocation = ToolInvocation {
            job_id: self.fence.job_id.clone(),
            tool_call_id: tool_call_id.to_owned(),
            idempotency_key: key.clone(),
            client: self.client.clone(),
            timeout: self.tool_timeout,
            traceparent: span.traceparent(),
            guard: self.guard.clone(),
            response_limit: self.tool_response_limit,
        };
        let executed = execute(invocation).await;
        self.record_tool(&spec, &key, attempt, span, executed).await
    }

    /// Records what attempt `attempt`'s execution of the call returned: its
    /// result (fenced: a lost lease records nothing and stops the call), or
    /// its failure, permanent or to be retried; a result the ledger cannot
    /// store (a NUL character) is a permanent failure.
    async fn record_tool(
        &mut self,
        spec: &crate::store::ledger::ToolCallSpec<'_>,
        key: &str,
        attempt: i32,
        mut span: crate::attempt_spans::StepSpan,
        executed: Result<String, StepError>,
    ) -> Result<String, StepError> {
        let (position, tool_name, tool_call_id) =
            (spec.position, spec.tool_name, spec.tool_call_id);
        let metrics = self.scope.metrics().clone();
        let result = match executed {
            Ok(result) => result,
            Err(error) => {
                let unknown = error.envelope().code == TOOL_OUTCOME_UNKNOWN;
                let permanent = unknown || !on_tool_error(&error).retries();
                let outcome = if unknown {
                    OUTCOME_UNKNOWN
                } else if permanent {
                    OUTCOME_FAILED
                } else {
                    OUTCOME_RETRIED
                };
                count_tool(&metrics, spec.server, outcome);
                span.set(KeyValue::new(ERROR_CODE, error.envelope().code));
                span.end(outcome);
                let failure = match (unknown, permanent) {
                    (true, _) => ToolFailure::Unknown,
                    (false, true) => ToolFailure::Permanent,
                    (false, false) => ToolFailure::Retry,
                };
                self.record_tool_failure(
                    key,
                    position,
                    &error.envelope(),
                    failure,
                    tool_name,
                    tool_call_id,
                )
                .await?;
                if unknown {
                    // Whatever the tool said, the job stops for a decision.
                    return Err(unknown_outcome(tool_name, tool_call_id));
                }
                return Err(match error {
                    StepError::Retry {
                        error, retry_after, ..
                    } => StepError::Retry {
                        error,
                        attempt: attempt.max(1) as u32,
                        retry_after,
                    },
                    other => other,
                });
            }
        };
        if result.contains('\0') {
            // The ledger stores the result as text, which refuses NUL: the
            // call failed for good, recorded as such (fenced).
            let error = crate::error::ErrorEnvelope {
                code: "invalid_tool_result".into(),
                message: format!("the result of tool call {tool_call_id} contains a NUL character"),
                retryable: false,
            };
            count_tool(&metrics, spec.server, OUTCOME_FAILED);
            span.set(KeyValue::new(ERROR_CODE, "invalid_tool_result"));
            span.end(OUTCOME_FAILED);
            self.record_tool_failure(
                key,
                position,
                &error,
                ToolFailure::Permanent,
                tool_name,
                tool_call_id,
            )
            .await?;
            return Err(StepError::Permanent {
                reason: format!("invalid tool result ({tool_name})"),
                error,
            });
        }
        self.faults
            .hit(self.job_id(), crate::faults::FailPoint::ToolAfterEffect)
            .await?;
        if !self
            .store
            .journal()
            .complete_tool_call(&self.fence, position, &result)
            .await?
        {
            span.end(OUTCOME_SUPPRESSED);
            return Err(StepError::LeaseLost);
        }
        count_tool(&metrics, spec.server, OUTCOME_PERFORMED);
        span.end(OUTCOME_PERFORMED);
        self.tool_event(key, FINISHED, tool_name, tool_call_id)
            .await?;
        Ok(result)
    }

    /// Waits until the ledger admits the call: `Ok((attempt, span))`, this
    /// attempt executes it (under the tool's span); `Err(result)`, it was
    /// done before (a replay, its result journaled); a conflict with the
    /// ledger fails it for good.
    async fn admit_tool(
        &mut self,
        spec: &crate::store::ledger::ToolCallSpec<'_>,
        key: &str,
        in_flight_ms: i64,
        mut span: crate::attempt_spans::StepSpan,
    ) -> Result<Result<(i32, crate::attempt_spans::StepSpan), String>, StepError> {
        use crate::store::ledger::ToolCallStart;
        let (turn, index) = (spec.position.turn, spec.position.index);
        let (tool_call_id, hash) = (spec.tool_call_id, spec.arguments_hash);
        loop {
            self.not_draining()?;
            match self
                .store
                .journal()
                .begin_tool_call(&self.fence, spec, in_flight_ms)
                .await?
            {
                ToolCallStart::Completed(result) => {
                    count_tool(self.scope.metrics(), spec.server, OUTCOME_REPLAYED);
                    span.end(OUTCOME_REPLAYED);
                    self.tool_event(key, REPLAYED, spec.tool_name, spec.tool_call_id)
                        .await?;
                    return Ok(Err(result));
                }
                ToolCallStart::Execute { attempt } => return Ok(Ok((attempt, span))),
                ToolCallStart::InFlight { .. } => tokio::time::sleep(self.wait_poll).await,
                ToolCallStart::LeaseLost => {
                    span.end(OUTCOME_SUPPRESSED);
                    return Err(StepError::LeaseLost);
                }
                ToolCallStart::Unknown => {
                    count_tool(self.scope.metrics(), spec.server, OUTCOME_UNKNOWN);
                    span.set(KeyValue::new(ERROR_CODE, TOOL_OUTCOME_UNKNOWN));
                    span.end(OUTCOME_FAILED);
                    return Err(unknown_outcome(spec.tool_name, tool_call_id));
                }
                ToolCallStart::Conflict {
                    stored_id,
                    stored_hash,
                } => {
                    count_tool(self.scope.metrics(), spec.server, OUTCOME_FAILED);
                    span.set(KeyValue::new(ERROR_CODE, "tool_call_conflict"));
                    return Err(StepError::permanent(
                        "tool_call_conflict",
                        format!(
                            "tool call {tool_call_id} at turn {turn}, index {index} does not match the ledger"
                        ),
                        format!(
                            "the ledger holds call {stored_id} with arguments hash {stored_hash}; this call has \
                             arguments hash {hash}; nothing was executed"
                        ),
                    ));
                }
            }
        }
    }

    /// Records a tool call's failure in the ledger (fenced; `permanent`:
    /// never run again) and its `failed` event.
    async fn record_tool_failure(
        &mut self,
        key: &str,
        position: crate::store::ledger::Position,
        error: &crate::error::ErrorEnvelope,
        failure: ToolFailure,
        tool_name: &str,
        tool_call_id: &str,
    ) -> Result<(), StepError> {
        if !self
            .store
            .journal()
            .fail_tool_call(&self.fence, position, error, failure)
            .await?
        {
            return Err(StepError::LeaseLost);
        }
        self.tool_event(key, FAILED, tool_name, tool_call_id).await
    }
}

/// The job's end when an at-most-once call's outcome is unknown.
fn unknown_outcome(tool_name: &str, tool_call_id: &str) -> StepError {
    StepError::permanent(
        TOOL_OUTCOME_UNKNOWN,
        format!(
            "tool call {tool_call_id} ({tool_name}) was sent and its answer was lost; the tool \
             may have run, and it is not marked read-only or idempotent"
        ),
        "nothing is sent again without a decision: redrive the job with confirm_unknown=true \
         to call it again under the same key",
    )
}

/// Counts a tool execution, and an MCP call by its server.
fn count_tool(
    metrics: &onceflow_observability::metrics::Metrics,
    server: Option<&str>,
    outcome: &'static str,
) {
    // A call left unknown is a failure to the tool counter's four outcomes.
    metrics.tool(if outcome == OUTCOME_UNKNOWN {
        OUTCOME_FAILED
    } else {
        outcome
    });
    if let Some(server) = server {
        metrics.mcp_call(server, outcome);
    }
}
