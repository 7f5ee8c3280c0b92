//! The durable context a workflow body runs through. Every side effect is
//! journaled under a key derived from the job and the step, and on a rerun
//! returns its journaled result instead of being done again.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::error::{ErrorEnvelope, StepError};
use crate::faults::Faults;
use crate::intake::canonical_hash;
use crate::keys;
use crate::outbound::PostError;
use crate::provider::Provider;
use crate::store::journal::{FailedSend, ModelCallStart};
use crate::store::{Checkpoint, Fence, Store};

/// Everything a step needs; built by the job actor for one attempt.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) fence: Fence,
    pub(crate) store: Store,
    pub(crate) provider: Arc<Provider>,
    pub(crate) faults: Faults,
    /// How often a step waiting on a concurrent attempt looks again.
    pub(crate) wait_poll: Duration,
}

/// How a model call was served, for callers that count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// This attempt sent the request.
    Performed,
    /// The journal already held the response.
    Replayed,
}

impl Context {
    /// The job's id (its business id).
    pub fn job_id(&self) -> &str {
        &self.fence.job_id
    }

    /// This attempt's number (1 on the first run).
    pub fn attempt(&self) -> i32 {
        self.fence.attempt
    }

    /// Calls the model with an OpenAI chat-completions `request`, journaled
    /// under `job:{id}:{step}`. Returns the provider's full response.
    ///
    /// The request is journaled (key and request hash) before it is sent; a
    /// rerun returns the journaled response; a concurrent attempt waits for
    /// the one in flight; the same key with a different request is a
    /// permanent error and nothing is sent.
    pub async fn generate(&mut self, step: &str, request: &Value) -> Result<Value, StepError> {
        self.generate_served(step, request).await.map(|(v, _)| v)
    }

    /// Like [`generate`](Self::generate), also telling whether it was replayed.
    pub async fn generate_served(
        &mut self,
        step: &str,
        request: &Value,
    ) -> Result<(Value, Served), StepError> {
        let key = keys::model_call(self.job_id(), step);
        let hash = canonical_hash(request);
        // The in-flight mark outlives the request timeout a little, so a
        // concurrent attempt does not send while ours may still be answered.
        let in_flight_ms = (self.provider.timeout() + Duration::from_secs(5)).as_millis() as i64;
        let attempt = loop {
            match self
                .store
                .begin_model_call(&self.fence, &key, &hash, in_flight_ms)
                .await?
            {
                ModelCallStart::Completed(response) => return Ok((response, Served::Replayed)),
                ModelCallStart::Send { attempt } => break attempt,
                ModelCallStart::InFlight { until } => {
                    tracing::debug!(job.id = self.job_id(), key, %until, "model call in flight elsewhere; waiting");
                    tokio::time::sleep(self.wait_poll).await;
                }
                ModelCallStart::KeyConflict { stored_hash } => {
                    return Err(StepError::permanent(
                        "model_key_conflict",
                        format!("model-call key {key} was journaled for a different request"),
                        format!(
                        "stored request hash {stored_hash}, this request {hash}; nothing was sent"
                    ),
                    ))
                }
                ModelCallStart::LeaseLost => return Err(StepError::LeaseLost),
            }
        };
        match self
            .provider
            .chat(&key, request, &self.faults, self.job_id())
            .await
        {
            Ok((response, usage)) => {
                match self
                    .store
                    .complete_model_call(
                        &self.fence,
                        &key,
                        &response,
                        (usage.input_tokens, usage.output_tokens),
                        &self.faults,
                    )
                    .await?
                {
                    Checkpoint::Moved => Ok((response, Served::Performed)),
                    Checkpoint::Faulted => {
                        Err(StepError::Injected(crate::faults::Injected::Crash(
                            crate::faults::FailPoint::BeforeCommit("model_call"),
                        )))
                    }
                    Checkpoint::LeaseLost | Checkpoint::AlreadyAt(_) => Err(StepError::LeaseLost),
                }
            }
            Err(PostError::Injected(injected)) => Err(injected.into()),
            Err(PostError::Failed(failure)) => {
                let error = failure.envelope();
                self.store
                    .fail_model_call(
                        &key,
                        &FailedSend {
                            error: error.clone(),
                            status: failure.status().map(i32::from),
                        },
                    )
                    .await?;
                Err(if failure.is_retryable() {
                    StepError::Retry {
                        error,
                        attempt: attempt.max(1) as u32,
                        retry_after: failure.retry_after(),
                    }
                } else {
                    StepError::Permanent {
                        reason: format!("the model provider refused the request ({key})"),
                        error: ErrorEnvelope {
                            retryable: false,
                            ..error
                        },
                    }
                })
            }
        }
    }
}
