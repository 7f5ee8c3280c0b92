//! The durable context a workflow body runs through. Every side effect is
//! journaled under a key derived from the job and the step, and on a rerun
//! returns its journaled result instead of being done again.
//!
//! This file holds the [`Context`] and the journal check every effect
//! starts with; each kind of effect has a file of its own: `generate` (a
//! model call), `tool` (a tool call, once per position), `step` (a general
//! step), `wait` (timers and signals), `children` (child jobs) and `tape`
//! (the journal of a streamed answer).

use std::sync::Arc;
use std::time::Duration;

use crate::attempt_spans::Scope;
use crate::error::StepError;
use crate::faults::Faults;
use crate::net::provider::Provider;
use crate::store::{Fence, Store};

mod children;
mod generate;
mod step;
mod tape;
mod tool;
mod wait;

pub(crate) use children::ChildRules;
pub use children::{child_id, Child, ChildFailed};
pub use step::{StepInvocation, MAX_PARALLEL_STEPS};
pub use tool::{SendMode, ToolCall, ToolInvocation, TOOL_OUTCOME_UNKNOWN};
pub use wait::{valid_wait_name, Decision, MAX_WAIT_NAME};

/// Everything a step needs; built by the job actor for one attempt.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) fence: Fence,
    pub(crate) store: Store,
    pub(crate) provider: Arc<Provider>,
    pub(crate) faults: Faults,
    /// How often a step waiting on a concurrent attempt looks again.
    pub(crate) wait_poll: Duration,
    pub(crate) client: reqwest::Client,
    /// Set when the node drains: no new side effect starts.
    pub(crate) draining: Arc<std::sync::atomic::AtomicBool>,
    /// Timeout of a tool's own requests.
    pub(crate) tool_timeout: Duration,
    /// Tool calls show on the job's event stream (see
    /// [`Context::show_tool_calls`]).
    pub(crate) tool_events: bool,
    /// The SSRF guard for the URLs tools and steps post to.
    pub(crate) guard: crate::net::guard::UrlGuard,
    /// Largest tool or step answer read.
    pub(crate) tool_response_limit: usize,
    /// This attempt's `job` span and the node's instruments.
    pub(crate) scope: Scope,
    /// Whether this rerun still follows the job's journal.
    pub(crate) replay: Replay,
    /// Provider limits shared by every node.
    pub(crate) limiter: Arc<crate::limiter::Limiter>,
    /// The job's priority: it orders the calls waiting for a provider limit.
    pub(crate) priority: i32,
    /// Waits for each signal name reached so far in this run of the body.
    pub(crate) signal_waits: std::collections::HashMap<String, u32>,
    /// Joins reached so far in this run of the body.
    pub(crate) joins: u32,
    /// What a child job must pass to start (the node's registry and guard).
    pub(crate) children: Arc<dyn ChildRules>,
    /// The API token the job belongs to, and so do its children.
    pub(crate) owner_token: Option<i64>,
    /// This node's watchers: a stream's committed chunks go to them.
    pub(crate) hub: Arc<crate::hub::Hub>,
}

/// What a rerun of a body has asked of the job's journal so far (see
/// [`Context::follow_journal`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Replay {
    /// Whether to check: not on a first attempt (nothing is journaled yet),
    /// nor once the rerun has asked for every journaled key.
    armed: bool,
    /// The job's journaled keys, oldest first; read on first use.
    journal: Option<Vec<crate::store::Journaled>>,
    /// The keys this attempt asked for.
    asked: std::collections::HashSet<String>,
}

impl Replay {
    pub(crate) fn for_attempt(attempt: i32) -> Self {
        Replay {
            armed: attempt > 1,
            ..Replay::default()
        }
    }
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
    /// Journals `rows` of `key`'s stream in `generation` under the
    /// attempt's fence, then hands what committed to the job's watchers on
    /// this node (other nodes' watchers hear of it by `NOTIFY`).
    pub(crate) async fn journal_stream(
        &self,
        key: &str,
        generation: i32,
        rows: Vec<crate::store::streams::StreamRow>,
    ) -> Result<(), StepError> {
        let (checkpoint, published) = self
            .store
            .journal()
            .stream(&self.fence, key, generation, rows)
            .await?;
        if !matches!(checkpoint, crate::store::Checkpoint::Moved) {
            return Err(StepError::LeaseLost);
        }
        self.hub.publish(&self.fence.job_id, published);
        Ok(())
    }

    /// `Err(Draining)` when the node drains: a side effect must not start.
    fn not_draining(&self) -> Result<(), StepError> {
        if self.draining.load(std::sync::atomic::Ordering::Acquire) {
            Err(StepError::Draining)
        } else {
            Ok(())
        }
    }

    /// Refuses a side effect whose `key` the journal lacks while a key the
    /// journal holds was never asked for by this rerun: the body no longer
    /// matches the job's journal (a changed body deployed under the same
    /// [`Workflow::VERSION`](crate::Workflow::VERSION)). Going on would call
    /// the model again for work already paid for, so the job fails,
    /// non-retryably, naming the step and the keys, and nothing is sent.
    ///
    /// A `ctx.step` is journaled only when its work succeeds (a body may go
    /// on past a failed one), so a step key the journal lacks is `optional`:
    /// it neither fails the check nor ends it.
    async fn follow_journal(
        &mut self,
        step: &str,
        key: &str,
        optional: bool,
    ) -> Result<(), StepError> {
        if !self.replay.armed {
            return Ok(());
        }
        let journal = match self.replay.journal.take() {
            Some(journal) => journal,
            None => self.store.journal().keys(&self.fence).await?,
        };
        self.replay.asked.insert(key.to_owned());
        let replayed = journal.iter().any(|k| k.key == key);
        let skipped: Vec<&str> = journal
            .iter()
            .filter(|k| !self.replay.asked.contains(&k.key))
            .map(|k| k.key.as_str())
            .collect();
        let outcome = if replayed || optional {
            Ok(())
        } else if skipped.is_empty() {
            // Past the journal's end: everything from here on is new.
            self.replay.armed = false;
            Ok(())
        } else {
            let skipped = skipped.join(", ");
            Err(StepError::permanent(
                "journal_mismatch",
                format!(
                    "the workflow's code no longer matches this job's journal: step {step:?} \
                     asks for {key}, which the journal lacks, while journaled {skipped} was never asked for"
                ),
                format!(
                    "step {step:?} asks for {key}, not in the journal, before journaled {skipped}; \
                     nothing was sent. Ship a changed body as a new Workflow::VERSION beside the old one, then redrive"
                ),
            ))
        };
        self.replay.journal = Some(journal);
        outcome
    }

    /// The outcome of wait `key` when the journal read by this rerun holds
    /// it over: a replay returns it without asking the store again.
    fn journaled_outcome(&self, key: &str) -> Option<serde_json::Value> {
        self.replay
            .journal
            .as_ref()?
            .iter()
            .find(|k| k.key == key)
            .and_then(|k| k.outcome.clone())
    }

    /// A wait's outcome journaled before this attempt began, as the wait
    /// machine decides it (its first rule: a journaled outcome is the
    /// wait's outcome); one it cannot read stops the job.
    fn journaled_wait(
        &self,
        key: &str,
        kind: crate::rules::wait_machine::WaitKind,
    ) -> Result<Option<crate::rules::wait_machine::WaitOutcome>, StepError> {
        use crate::rules::wait_machine::{decide, Decision, Seen, WaitOutcome};
        let Some(raw) = self.journaled_outcome(key) else {
            return Ok(None);
        };
        let journaled = WaitOutcome::from_json(&raw).ok_or_else(|| {
            StepError::permanent(
                "invalid_journal",
                format!("the journaled outcome of {key:?} is not one this node reads"),
                raw.to_string(),
            )
        })?;
        Ok(match decide(kind, Some(journaled), Seen::default()) {
            Decision::Over(outcome) => Some(outcome),
            Decision::Wait => None,
        })
    }

    /// The job's id (its business id).
    pub fn job_id(&self) -> &str {
        &self.fence.job_id
    }

    /// The prefix of every key of this incarnation of the job (`job:{id}`,
    /// `job:{id}#{n}` for an id submitted again after its job was purged):
    /// build a side effect's own key on it, never on the bare id.
    pub fn job_key(&self) -> crate::rules::keys::JobKey {
        self.fence.key()
    }

    /// This attempt's number (1 on the first run).
    pub fn attempt(&self) -> i32 {
        self.fence.attempt
    }

    /// How long one tool call may take on this node (the webhook timeout).
    pub fn tool_timeout(&self) -> std::time::Duration {
        self.tool_timeout
    }

    /// The HTTP client steps and tools should use.
    pub fn http(&self) -> &reqwest::Client {
        &self.client
    }
}

/// Gathers the branches of a parallel batch (`ctx.generate_all`,
/// `ctx.steps`): each yields its index and its outcome. A lost lease, a
/// drain or a crash ends the batch at once (the branches still running are
/// dropped mid-way, as a killed process would leave them); otherwise every
/// branch runs to its end, and the worst failure (a permanent one over a
/// retry, and the retry with the most of its budget spent over another) is
/// the batch's, or else every branch's output, in order.
async fn gather<T>(
    n: usize,
    mut running: impl futures_util::Stream<Item = (usize, Result<T, StepError>)> + Unpin,
) -> Result<Vec<T>, StepError> {
    use futures_util::StreamExt;
    let mut outputs: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut failed: Option<StepError> = None;
    while let Some((i, output)) = running.next().await {
        match output {
            Ok(output) => outputs[i] = Some(output),
            Err(
                e @ (StepError::LeaseLost
                | StepError::Draining
                | StepError::Injected(crate::faults::Injected::Crash(_))),
            ) => return Err(e),
            Err(e) => {
                // A retry with more of its budget spent is worse too: the
                // batch's verdict is that of its most spent branch.
                let worse = match (&failed, &e) {
                    (None, _) => true,
                    (Some(StepError::Retry { .. }), StepError::Permanent { .. }) => true,
                    (
                        Some(StepError::Retry { attempt: was, .. }),
                        StepError::Retry { attempt: now, .. },
                    ) => now > was,
                    _ => false,
                };
                if worse {
                    failed = Some(e);
                }
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every branch answered"))
        .collect())
}
