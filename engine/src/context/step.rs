//! `ctx.step`: general work run once per job under a step name, fenced
//! before it runs and journaled when it succeeds.

use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;

use super::Context;
use crate::error::StepError;
use crate::rules::keys;

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
    pub guard: crate::net::guard::UrlGuard,
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

/// Most steps one [`Context::step_all`] runs at once.
pub const MAX_PARALLEL_STEPS: usize = 100;

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
        self.run_step(name, key, work).await
    }

    /// A retryable failure of the body itself (not of a step's work), with
    /// a retry budget of its own: counted in the journal under
    /// `job:{id}:retry:{name}`, so the job runs again after a backoff until
    /// `name` has failed the policy's number of times, then is dead
    /// (`retry budget exhausted after N sends`). Waits, other steps and
    /// other names spend none of it (unlike [`attempt`](Self::attempt),
    /// which counts every lease of the job); a redrive gives a fresh one.
    /// Return what it gives: `return Err(ctx.retry("tool-missing", error).await)`.
    pub async fn retry(&self, name: &str, error: crate::error::ErrorEnvelope) -> StepError {
        let key = keys::retry(&self.fence.key(), name);
        match self.store.journal().count_failure(&self.fence, &key).await {
            Ok(Some(failures)) => StepError::Retry {
                error,
                attempt: failures,
                retry_after: None,
            },
            Ok(None) => StepError::LeaseLost,
            Err(e) => StepError::Store(e),
        }
    }

    /// Runs several steps at once, each as [`step`](Self::step) runs one:
    /// fenced before its work, journaled under `job:{id}:step:{name}` when
    /// it succeeds, replayed on a rerun. Outputs come in the order given.
    /// After a crash the finished steps replay and only the others run
    /// again. A lost lease, a drain or an injected crash stops the batch at
    /// once; otherwise every step runs to its end, and the first failure
    /// (a permanent one before a retryable one) is returned. At most
    /// [`MAX_PARALLEL_STEPS`] steps; names must differ.
    pub async fn step_all<T, F, Fut>(&mut self, steps: Vec<(&str, F)>) -> Result<Vec<T>, StepError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(StepInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<T, StepError>>,
    {
        use futures_util::stream::FuturesUnordered;
        if steps.len() > MAX_PARALLEL_STEPS {
            return Err(StepError::permanent(
                "too_many_steps",
                format!("step_all takes at most {MAX_PARALLEL_STEPS} steps at once"),
                format!("the body gave {}", steps.len()),
            ));
        }
        let keys: Vec<String> = steps
            .iter()
            .map(|(name, _)| keys::step(&self.fence.key(), name))
            .collect();
        if let Some((_, dup)) = keys
            .iter()
            .enumerate()
            .find(|(i, k)| keys[..*i].contains(k))
        {
            return Err(StepError::permanent(
                "duplicate_step",
                format!("step_all was given step key {dup} twice"),
                "each step of a batch needs its own name".to_owned(),
            ));
        }
        // Journaled in whatever order they finished: asked together.
        if self.replay.armed {
            self.replay.asked.extend(keys.iter().cloned());
        }
        for ((name, _), key) in steps.iter().zip(&keys) {
            Box::pin(self.follow_journal(name, key, true)).await?;
        }
        let n = steps.len();
        let this = &*self;
        let running: FuturesUnordered<_> = steps
            .into_iter()
            .zip(keys)
            .enumerate()
            .map(|(i, ((name, work), key))| {
                Box::pin(async move { (i, this.run_step(name, key, work).await) })
            })
            .collect();
        super::gather(n, running).await
    }

    /// One step after its journal check: fenced, run, journaled.
    async fn run_step<T, F, Fut>(&self, name: &str, key: String, work: F) -> Result<T, StepError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(StepInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<T, StepError>>,
    {
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
        match self.store.journal().begin_step(&self.fence, &key).await? {
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
        let worked = work(StepInvocation {
            job_id: self.fence.job_id.clone(),
            idempotency_key: key.clone(),
            client: self.client.clone(),
            traceparent: span.traceparent(),
            guard: self.guard.clone(),
            response_limit: self.tool_response_limit,
        })
        .await;
        let output = match worked {
            Ok(output) => output,
            // The step's own failures are its retry budget, counted in the
            // journal (whatever `attempt` the work reported): a step that
            // keeps failing ends the job dead once the budget is spent.
            Err(StepError::Retry {
                error, retry_after, ..
            }) => {
                let failures = self
                    .store
                    .journal()
                    .count_failure(&self.fence, &key)
                    .await?;
                let Some(failures) = failures else {
                    span.end(OUTCOME_SUPPRESSED);
                    return Err(StepError::LeaseLost);
                };
                span.end(OUTCOME_FAILED);
                return Err(StepError::Retry {
                    error,
                    attempt: failures,
                    retry_after,
                });
            }
            Err(other) => {
                span.end(OUTCOME_FAILED);
                return Err(other);
            }
        };
        self.faults
            .hit(self.job_id(), crate::faults::FailPoint::StepAfterEffect)
            .await?;
        let text =
            serde_json::to_string(&output).map_err(|e| StepError::Serialize(e.to_string()))?;
        match self
            .store
            .journal()
            .record_step(&self.fence, &key, &text)
            .await?
        {
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
