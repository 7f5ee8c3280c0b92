//! Fault injection: named failpoints at every boundary of every workflow.
//!
//! A test (or the demo, `onceflow-bench demo`) arms a point for a job, or for any job, to
//! fail once, crash the attempt, stall it, or freeze it (and its node's
//! lease renewal) so another node takes over. The engine calls
//! [`Faults::hit`] at each boundary; with nothing armed that is one atomic
//! load. A crash stops the attempt where it stands: nothing more is written,
//! the lease is not released, and recovery is the supervisor's job, exactly as
//! after a killed process.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A boundary in a job's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailPoint {
    /// Before a checkpoint's write commits; nothing of it is durable yet.
    /// For one-statement writes (`model_call`, `generated`, `persisted`,
    /// `claimed`, `delivered`) it is hit just before the statement, so a
    /// stall here holds no row lock. Named by the state it moves to or
    /// `model_call`.
    BeforeCommit(&'static str),
    /// Right after a checkpoint committed, before the next side effect.
    AfterCommit(&'static str),
    /// The model request was sent and answered; its response is not read yet.
    ModelAfterSend,
    /// Mid-stream: a streamed model call's first chunks are journaled (and
    /// shown to watchers), the rest of the answer has not arrived yet. Hit
    /// once per streamed call, after its first journaled batch.
    StreamChunk,
    /// The webhook request was sent and answered; its response is not read yet.
    WebhookAfterSend,
    /// A tool's side effect happened; its result is not recorded yet.
    ToolAfterEffect,
    /// A general step's work is done; its output is not journaled yet.
    StepAfterEffect,
    /// The ack, after delivery, before the `acked` checkpoint.
    Ack,
}

impl fmt::Display for FailPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailPoint::BeforeCommit(s) => write!(f, "before-commit:{s}"),
            FailPoint::AfterCommit(s) => write!(f, "after-commit:{s}"),
            FailPoint::ModelAfterSend => f.write_str("model:after-send"),
            FailPoint::StreamChunk => f.write_str("stream:chunk"),
            FailPoint::WebhookAfterSend => f.write_str("webhook:after-send"),
            FailPoint::ToolAfterEffect => f.write_str("tool:after-effect"),
            FailPoint::StepAfterEffect => f.write_str("step:after-effect"),
            FailPoint::Ack => f.write_str("ack"),
        }
    }
}

/// What an armed failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Return a retryable error from this step (the job is retried later).
    Fail,
    /// Stop the attempt on the spot, as a killed process would.
    Crash,
    /// Sleep this long, then carry on (slow a write). The node keeps
    /// renewing the lease meanwhile, as it would for a slow step.
    Stall(Duration),
    /// Freeze the attempt this long *and* its node's lease renewal and
    /// polling, as a paused or partitioned worker: another node takes the job
    /// over while this attempt is still alive, and it resumes afterwards as a
    /// zombie.
    Freeze(Duration),
}

/// A failpoint fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Injected {
    /// An [`Action::Fail`] fired here: a retryable failure of the step.
    #[error("injected failure at {0}")]
    Fail(FailPoint),
    /// An [`Action::Crash`] fired here: the attempt stops as a killed process would.
    #[error("injected crash at {0}")]
    Crash(FailPoint),
}

#[derive(Debug)]
struct Armed {
    job: Option<String>,
    point: FailPoint,
    action: Action,
    /// Matching hits to let pass before firing.
    skip: u32,
    remaining: u32,
}

#[derive(Debug, Default)]
struct Inner {
    any: AtomicBool,
    frozen: Mutex<std::collections::HashSet<String>>,
    armed: Mutex<Vec<Armed>>,
    recording: AtomicBool,
    hits: Mutex<Vec<(String, FailPoint)>>,
    fired: Mutex<Vec<(String, FailPoint, Action)>>,
}

/// The failpoint registry of one engine. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Faults(Arc<Inner>);

impl Faults {
    /// A registry with nothing armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Arms `point` for `job` (or every job when `None`) to fire `times` times.
    pub fn arm(&self, job: Option<&str>, point: FailPoint, action: Action, times: u32) {
        self.0.armed.lock().expect("faults lock").push(Armed {
            job: job.map(str::to_owned),
            point,
            action,
            skip: 0,
            remaining: times,
        });
        self.0.any.store(true, Ordering::Release);
    }

    /// Arms `point` for `job` to fire once.
    pub fn arm_once(&self, job: &str, point: FailPoint, action: Action) {
        self.arm(Some(job), point, action, 1);
    }

    /// Arms `point` for `job` to fire once, on its `nth` hit (1-based): the
    /// second model call of a job, say.
    pub fn arm_nth(&self, job: &str, point: FailPoint, action: Action, nth: u32) {
        self.0.armed.lock().expect("faults lock").push(Armed {
            job: Some(job.to_owned()),
            point,
            action,
            skip: nth.saturating_sub(1),
            remaining: 1,
        });
        self.0.any.store(true, Ordering::Release);
    }

    /// Records every boundary passed from now on (see [`hits`](Self::hits)).
    pub fn record(&self) {
        self.0.recording.store(true, Ordering::Release);
    }

    /// The boundaries passed while recording, in order.
    pub fn hits(&self) -> Vec<(String, FailPoint)> {
        self.0.hits.lock().expect("faults lock").clone()
    }

    /// Whether an armed failpoint has fired for `job`.
    pub fn fired(&self, job: &str) -> bool {
        self.0
            .fired
            .lock()
            .expect("faults lock")
            .iter()
            .any(|(j, _, _)| j == job)
    }

    /// Whether an armed failpoint has fired for `job` at `point`.
    pub fn fired_at(&self, job: &str, point: FailPoint) -> bool {
        self.0
            .fired
            .lock()
            .expect("faults lock")
            .iter()
            .any(|(j, p, _)| j == job && *p == point)
    }

    /// True while any attempt is frozen: its node does not poll for work.
    pub fn any_frozen(&self) -> bool {
        self.0.any.load(Ordering::Acquire) && !self.0.frozen.lock().expect("faults lock").is_empty()
    }

    /// True while an attempt of `job` is frozen: its lease is not renewed.
    pub fn is_frozen(&self, job: &str) -> bool {
        self.0.any.load(Ordering::Acquire)
            && self.0.frozen.lock().expect("faults lock").contains(job)
    }

    /// Called by the engine at each boundary.
    pub async fn hit(&self, job: &str, point: FailPoint) -> Result<(), Injected> {
        if self.0.recording.load(Ordering::Acquire) {
            self.0
                .hits
                .lock()
                .expect("faults lock")
                .push((job.to_owned(), point));
        }
        if !self.0.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let action = {
            let mut armed = self.0.armed.lock().expect("faults lock");
            let found = armed.iter_mut().find(|a| {
                a.point == point && a.remaining > 0 && a.job.as_deref().is_none_or(|j| j == job)
            });
            match found {
                Some(a) if a.skip > 0 => {
                    a.skip -= 1;
                    None
                }
                Some(a) => {
                    a.remaining -= 1;
                    Some(a.action)
                }
                None => None,
            }
        };
        if let Some(action) = action {
            self.0
                .fired
                .lock()
                .expect("faults lock")
                .push((job.to_owned(), point, action));
        }
        match action {
            None => Ok(()),
            Some(Action::Fail) => {
                tracing::info!(job.id = job, %point, "failpoint: fail");
                Err(Injected::Fail(point))
            }
            Some(Action::Crash) => {
                tracing::info!(job.id = job, %point, "failpoint: crash");
                Err(Injected::Crash(point))
            }
            Some(Action::Stall(d)) => {
                tracing::info!(job.id = job, %point, stall_ms = d.as_millis() as u64, "failpoint: stall");
                tokio::time::sleep(d).await;
                Ok(())
            }
            Some(Action::Freeze(d)) => {
                tracing::info!(job.id = job, %point, freeze_ms = d.as_millis() as u64, "failpoint: freeze");
                self.0
                    .frozen
                    .lock()
                    .expect("faults lock")
                    .insert(job.to_owned());
                tokio::time::sleep(d).await;
                self.0.frozen.lock().expect("faults lock").remove(job);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fires_for_its_job_the_armed_number_of_times() {
        let f = Faults::new();
        f.arm(Some("a"), FailPoint::Ack, Action::Crash, 2);
        assert_eq!(f.hit("b", FailPoint::Ack).await, Ok(()));
        assert_eq!(f.hit("a", FailPoint::ModelAfterSend).await, Ok(()));
        assert_eq!(
            f.hit("a", FailPoint::Ack).await,
            Err(Injected::Crash(FailPoint::Ack))
        );
        assert_eq!(
            f.hit("a", FailPoint::Ack).await,
            Err(Injected::Crash(FailPoint::Ack))
        );
        assert_eq!(f.hit("a", FailPoint::Ack).await, Ok(()));
    }

    #[tokio::test]
    async fn arm_nth_lets_earlier_hits_pass() {
        let f = Faults::new();
        f.arm_nth("a", FailPoint::ModelAfterSend, Action::Fail, 2);
        assert_eq!(f.hit("a", FailPoint::ModelAfterSend).await, Ok(()));
        assert!(f.hit("a", FailPoint::ModelAfterSend).await.is_err());
        assert_eq!(f.hit("a", FailPoint::ModelAfterSend).await, Ok(()));
    }

    #[tokio::test]
    async fn records_boundaries_in_order() {
        let f = Faults::new();
        f.record();
        f.hit("j", FailPoint::AfterCommit("generated"))
            .await
            .unwrap();
        f.hit("j", FailPoint::Ack).await.unwrap();
        assert_eq!(
            f.hits(),
            vec![
                ("j".into(), FailPoint::AfterCommit("generated")),
                ("j".into(), FailPoint::Ack)
            ]
        );
    }
}
