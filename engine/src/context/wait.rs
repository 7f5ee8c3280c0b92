//! `ctx.sleep`, `ctx.sleep_until` and `ctx.wait_for_signal`: durable waits.
//! A wait not yet over ends the attempt (`StepError::Waiting`, which the
//! body passes on with `?`) with the job released until it is due; the
//! body replays to the wait when the job runs again, and a wait that is
//! over returns its journaled outcome (see [`crate::store::waits`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::Context;
use crate::error::StepError;
use crate::faults::FailPoint;
use crate::rules::keys;
use crate::rules::wait_machine::{ApprovalCall, WaitOutcome};
use crate::store::waits::{Until, WaitAsk, WaitKind, WaitStep};

pub use crate::rules::signal::{valid_wait_name, Decision, MAX_WAIT_NAME};

impl Context {
    /// Waits `duration` (from when the body first reaches this timer, by
    /// the database's clock), journaled under `job:{id}:sleep:{name}`. The
    /// job holds no actor, lease or connection meanwhile; a replay after
    /// the timer fired returns at once. Pass the error on with `?`: a timer
    /// not yet due ends the attempt with [`StepError::Waiting`]. The name
    /// is the timer: a second `sleep` of a name in one run is the same
    /// timer and returns at once, so a loop names each one
    /// (`format!("poll:{i}")`).
    pub async fn sleep(&mut self, name: &str, duration: Duration) -> Result<(), StepError> {
        self.wait(
            WaitKind::Sleep,
            name,
            keys::sleep(&self.fence.key(), name),
            Until::After(duration),
            None,
            None,
        )
        .await
        .map(|_| ())
    }

    /// [`sleep`](Self::sleep) until `at`.
    pub async fn sleep_until(&mut self, name: &str, at: DateTime<Utc>) -> Result<(), StepError> {
        self.wait(
            WaitKind::Sleep,
            name,
            keys::sleep(&self.fence.key(), name),
            Until::At(at),
            None,
            None,
        )
        .await
        .map(|_| ())
    }

    /// Waits for a signal named `name` (`POST /v1/jobs/{id}/signals/{name}`)
    /// for at most `timeout`; returns its payload, or `None` on timeout. A
    /// signal sent before the wait is kept and taken here; several of one
    /// name are taken oldest first, one per wait (the `n`-th wait of a name
    /// in a run is journaled under `job:{id}:signal:{name}#{n}`, the first
    /// under `job:{id}:signal:{name}`). Pass the error on with `?`.
    pub async fn wait_for_signal<T: DeserializeOwned>(
        &mut self,
        name: &str,
        timeout: Duration,
    ) -> Result<Option<T>, StepError> {
        self.signal_wait(WaitKind::Signal, name, timeout, None)
            .await
    }

    /// Asks a person to approve tool call `tool_call_id` (`tool_name` with
    /// `arguments`) before it runs: waits for the signal
    /// `approval:{tool_call_id}` with payload `{"approved": bool, "note"?}`
    /// for at most `timeout`, and returns the decision, or `None` on
    /// timeout. The job's `waiting` shows the tool call; when the job starts
    /// waiting it sends a `job.waiting` event to its `webhook_url`, once per
    /// wait, under `job:{id}:waiting:approval:{tool_call_id}` (the `n`-th
    /// wait for one id in a run: `…#{n}`, like its wait's key).
    pub async fn wait_for_approval(
        &mut self,
        tool_call_id: &str,
        tool_name: &str,
        arguments: &Value,
        timeout: Duration,
    ) -> Result<Option<Decision>, StepError> {
        let name = format!("approval:{tool_call_id}");
        let tool = ApprovalCall {
            tool_call_id: tool_call_id.to_owned(),
            name: tool_name.to_owned(),
            arguments: arguments.clone(),
        };
        self.signal_wait(WaitKind::Approval, &name, timeout, Some(&tool))
            .await
    }

    /// A wait for signal `name` of `kind` (a signal, or an approval).
    async fn signal_wait<T: DeserializeOwned>(
        &mut self,
        kind: WaitKind,
        name: &str,
        timeout: Duration,
        tool: Option<&ApprovalCall>,
    ) -> Result<Option<T>, StepError> {
        let nth = {
            let n = self.signal_waits.entry(name.to_owned()).or_insert(0);
            *n += 1;
            *n
        };
        let key = keys::signal(&self.fence.key(), name, nth);
        // Each approval wait sends its own `job.waiting`, once.
        let event =
            (kind == WaitKind::Approval).then(|| keys::waiting(&self.fence.key(), name, nth));
        let outcome = self
            .wait(kind, name, key, Until::After(timeout), tool, event)
            .await?;
        match outcome.into_signal() {
            Some(signal) => serde_json::from_value(signal.payload)
                .map(Some)
                .map_err(|e| {
                    StepError::permanent(
                        "invalid_signal",
                        format!("the payload of signal {name:?} does not fit the workflow's type"),
                        e.to_string(),
                    )
                }),
            None => Ok(None),
        }
    }

    async fn wait(
        &mut self,
        kind: WaitKind,
        name: &str,
        key: String,
        until: Until,
        tool: Option<&ApprovalCall>,
        event: Option<(String, String)>,
    ) -> Result<WaitOutcome, StepError> {
        if !valid_wait_name(name) {
            return Err(StepError::permanent(
                "invalid_wait_name",
                format!(
                    "a {} name must be 1-{MAX_WAIT_NAME} characters of A-Z a-z 0-9 _ . : -",
                    kind.as_str()
                ),
                format!("the body asked for {name:?}"),
            ));
        }
        self.follow_journal(name, &key, false).await?;
        if let Some(outcome) = self.journaled_wait(&key, kind)? {
            // Over before this attempt began (a due timer is recorded as the
            // job is picked up): nothing to write.
            return Ok(outcome);
        }
        self.not_draining()?;
        let ask = WaitAsk {
            key: &key,
            kind,
            name,
            until,
            tool,
            event: event.as_ref().map(|(k, e)| (k.as_str(), e.as_str())),
        };
        // Boundaries for the crash-point explorer: before the wait is
        // journaled (nothing of it is durable), and after (the job is
        // released, or the wait's outcome recorded).
        self.faults
            .hit(self.job_id(), FailPoint::BeforeCommit("wait"))
            .await?;
        let step = Box::pin(self.store.waits().wait(&self.fence, &ask)).await?;
        if step != WaitStep::LeaseLost {
            self.faults
                .hit(self.job_id(), FailPoint::AfterCommit("wait"))
                .await?;
        }
        match step {
            WaitStep::Done(outcome) => Ok(outcome),
            WaitStep::Waiting { until, due } => Err(StepError::Waiting {
                kind: kind.as_str(),
                name: name.to_owned(),
                until,
                due,
            }),
            WaitStep::LeaseLost => Err(StepError::LeaseLost),
        }
    }
}
