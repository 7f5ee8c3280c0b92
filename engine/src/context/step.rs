//! `ctx.step`: general work run once per job under a step name, fenced
//! before it runs and journaled when it succeeds.

use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use super::Context;
use crate::error::StepError;
use crate::keys;

/// What a general step's work gets.
#[derive(Debug, Clone)]
pub struct StepInvocation {
    /// The job running the step.
    pub job_id: String,
    /// `job:{id}:step:{name}`: send it with the step's own side effect.
    pub idempotency_key: String,
    /// The guarded client (no redirects; names resolved through the guard).
    pub client: reqwest::Client,
    /// The job's W3C trace context, to send along (`traceparent`).
    pub traceparent: String,
    /// The SSRF guard for the step's own requests.
    pub guard: crate::guard::UrlGuard,
    /// Largest answer a step should read.
    pub response_limit: usize,
}

impl StepInvocation {
    /// POSTs `body` as JSON to `url` with the step's `Idempotency-Key`,
    /// through the guarded client; returns the answer's body as text. As
    /// [`ToolInvocation::post_json`](super::ToolInvocation::post_json):
    /// 408, 429, 5xx and network errors are retryable, other statuses
    /// permanent.
    pub async fn post_json(
        &self,
        url: &str,
        body: &serde_json::Value,
    ) -> Result<String, StepError> {
        super::ToolInvocation {
            job_id: self.job_id.clone(),
            tool_call_id: String::new(),
            idempotency_key: self.idempotency_key.clone(),
            client: self.client.clone(),
            timeout: std::time::Duration::from_secs(10),
            traceparent: self.traceparent.clone(),
            guard: self.guard.clone(),
            response_limit: self.response_limit,
        }
        .post_json(url, body)
        .await
    }
}

impl Context {
    /// Runs `work` once per job under step `name` and journals its output; a
    /// rerun returns the journaled output. A crash after `work` and before
    /// the journal commit runs it again, with the same
    /// [`StepInvocation::idempotency_key`]: pass that key to the side effect
    /// so its receiver can drop the repeat.
    pub async fn step<T, F, Fut>(&mut self, name: &str, work: F) -> Result<T, StepError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(StepInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<T, StepError>>,
    {
        let key = keys::step(&self.fence.key(), name);
        self.follow_journal(name, &key, true).await?;
        let decode = |text: &str| {
            serde_json::from_str::<T>(text)
                .map_err(|e| StepError::Serialize(format!("journaled output of step {name}: {e}")))
        };
        let span = self.scope.step(
            SPAN_STEP,
            SpanKind::Internal,
            vec![
                KeyValue::new(STEP, name.to_owned()),
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
            ],
        );
        // Fenced before the work runs: a cancelled or taken-over attempt
        // runs no step body.
        match self.store.begin_step(&self.fence, &key).await? {
            None => {
                span.end(OUTCOME_SUPPRESSED);
                return Err(StepError::LeaseLost);
            }
            Some(Some(stored)) => {
                span.end(OUTCOME_REPLAYED);
                return decode(&stored);
            }
            Some(None) => {}
        }
        self.not_draining()?;
        let output = work(StepInvocation {
            job_id: self.fence.job_id.clone(),
            idempotency_key: key.clone(),
            client: self.client.clone(),
            traceparent: span.traceparent(),
            guard: self.guard.clone(),
            response_limit: self.tool_response_limit,
        })
        .await?;
        self.faults
            .hit(self.job_id(), crate::faults::FailPoint::StepAfterEffect)
            .await?;
        let text =
            serde_json::to_string(&output).map_err(|e| StepError::Serialize(e.to_string()))?;
        match self.store.record_step(&self.fence, &key, &text).await? {
            Some(stored) => {
                span.end(OUTCOME_PERFORMED);
                decode(&stored)
            }
            None => {
                span.end(OUTCOME_SUPPRESSED);
                Err(StepError::LeaseLost)
            }
        }
    }
}
