//! Hand-off: a job accepted by a node whose engine has room and budget
//! left — the room its last acquire left over, so there is no queue of
//! older or higher-priority work to jump — is inserted *already leased*
//! to that node — in intake's own statement and commit — and its actor
//! starts when the commit returns. It saves the acquire statement, its
//! commit and the `NOTIFY` round trip on the path from submit to webhook.
//!
//! Nothing about the guarantees changes: the lease is the same row columns
//! an acquire writes (owner, epoch + 1, expiry, attempts 1), durable in the
//! commit that creates the job, so a node that dies before or after the
//! actor starts leaves a lease that lapses, and any node resumes the job
//! from `received` like any stalled job. A job the node cannot take (full,
//! no budget, draining, a workflow version it lacks, a schedule for later)
//! is inserted unleased and woken by `NOTIFY` as before.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use actix::Addr;

use crate::error::{BatchError, StoreError};
use crate::faults::FailPoint;
use crate::node::shared::Shared;
use crate::node::supervisor::{Adopt, ReclaimOwn, Supervisor};
use crate::store::jobs::HandTo;
use crate::store::Leased;

/// This node's engine, as intake sees it: where a new job may be handed.
#[derive(Clone)]
pub struct Handoff {
    shared: Arc<Shared>,
    supervisor: Addr<Supervisor>,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field("node", &self.shared.config.node_id)
            .finish()
    }
}

/// Room reserved on this node for one new job; released when dropped
/// unless the job was handed to the supervisor.
#[derive(Debug)]
pub struct Reservation {
    handoff: Handoff,
    adopted: bool,
    /// The job it is for, once [`hand_to`](Self::hand_to) named it.
    job: Option<String>,
}

impl Handoff {
    pub(crate) fn new(shared: Arc<Shared>, supervisor: Addr<Supervisor>) -> Self {
        Handoff { shared, supervisor }
    }

    /// Reserves room for a new job of `workflow`@`version` that is due now,
    /// or `None` when it must go through the queue.
    pub fn reserve(&self, workflow: &str, version: i32) -> Option<Reservation> {
        let shared = &self.shared;
        let gate = &shared.gate;
        if gate.closed.load(Ordering::Acquire)
            || shared.is_draining()
            || shared.faults.any_frozen()
            || shared.registry.get_version(workflow, version).is_none()
        {
            return None;
        }
        gate.budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| b.checked_sub(1))
            .ok()?;
        let max = shared.config.max_in_flight;
        let room = gate
            .reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (gate.running.load(Ordering::Acquire) + r < max).then_some(r + 1)
            });
        if room.is_err() {
            gate.budget.fetch_add(1, Ordering::AcqRel);
            return None;
        }
        Some(Reservation {
            handoff: self.clone(),
            adopted: false,
            job: None,
        })
    }

    /// The node the lease is written for.
    pub fn node(&self) -> &str {
        &self.shared.config.node_id
    }

    /// The lease's length, in milliseconds.
    pub fn lease_ms(&self) -> i64 {
        self.shared.config.lease.as_millis() as i64
    }

    /// `job` is no longer being handed to this node.
    fn handed(&self, job: &str) {
        self.shared.gate.handing.lock().expect("lock").remove(job);
    }

    /// Hand-offs this node would take now (the room its last acquire left).
    pub fn budget(&self) -> usize {
        self.shared.gate.budget.load(Ordering::Acquire)
    }

    /// Reservations not yet adopted or given back.
    pub fn reserved(&self) -> usize {
        self.shared.gate.reserved.load(Ordering::Acquire)
    }
}

impl Reservation {
    /// The node the lease is written for.
    pub fn node(&self) -> &str {
        self.handoff.node()
    }

    /// The lease's length, in milliseconds.
    pub fn lease_ms(&self) -> i64 {
        self.handoff.lease_ms()
    }

    /// Where the store is to lease new job `job_id` in intake's commit.
    /// From now until its `Adopt` is handled (or the reservation is given
    /// back), the job is one this node is handing itself: no reclaim
    /// takes it. `None` while an acquire that takes back this node's own
    /// leases runs (it read the jobs being handed before this one): the
    /// job goes through the queue instead.
    pub fn hand_to(&mut self, job_id: &str) -> Option<HandTo> {
        {
            let mut handing = self.handoff.shared.gate.handing.lock().expect("lock");
            if self.handoff.shared.gate.reclaiming.load(Ordering::Acquire) {
                return None;
            }
            handing.insert(job_id.to_owned());
        }
        self.job = Some(job_id.to_owned());
        Some(HandTo {
            node: self.node().to_owned(),
            lease_ms: self.lease_ms(),
        })
    }

    /// Hands the job, leased in intake's commit, to the supervisor, which
    /// starts its actor (or, stopping, lets the lease lapse).
    ///
    /// The failpoint `after-commit:intake` (action `fail`) stands for an
    /// answer lost after the commit landed: the job is then left as
    /// [`orphaned`](Self::orphaned) leaves it, and the caller gets an error.
    pub async fn adopt(mut self, leased: Leased) -> Result<(), StoreError> {
        let faults = &self.handoff.shared.faults;
        if faults
            .hit(&leased.fence.job_id, FailPoint::AfterCommit("intake"))
            .await
            .is_err()
        {
            self.orphaned();
            return Err(BatchError::Dropped.into());
        }
        self.adopted = true;
        self.handoff.supervisor.do_send(Adopt(leased));
        Ok(())
    }

    /// Intake's commit may have landed without its answer reaching us (an
    /// error after the statement, or a batch written again one by one that
    /// then found its own row): the job may be leased to this node with no
    /// actor. Rather than leave it until the lease lapses, the supervisor
    /// takes back, in its next acquire, this node's leases that no actor
    /// here runs (the same reclaim a node does at start). The room held is
    /// given back.
    pub fn orphaned(mut self) {
        // No longer being handed: the reclaim may take it.
        if let Some(job) = self.job.take() {
            self.handoff.handed(&job);
        }
        self.handoff.supervisor.do_send(ReclaimOwn);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.adopted {
            // Not handed off after all (the id existed, the insert failed):
            // the room and the budget are given back.
            let gate = &self.handoff.shared.gate;
            gate.reserved.fetch_sub(1, Ordering::AcqRel);
            gate.budget.fetch_add(1, Ordering::AcqRel);
            if let Some(job) = self.job.take() {
                self.handoff.handed(&job);
            }
        }
    }
}

/// Records a job submitted to this node's API (`submission`, whose
/// `hand_to` is filled here) and, when it is new and due
/// now and this node has room (`handoff`), hands it to this node in
/// intake's own commit and adopts it. The store's work runs on a task of
/// its own: a caller that goes away while the batch commits must not
/// strand a handed-off job (committed leased, never adopted).
pub(crate) async fn submit(
    store: &crate::store::Store,
    handoff: Option<&Handoff>,
    submission: crate::store::Submission<'_>,
) -> Result<crate::store::Intake, StoreError> {
    use crate::store::{Intake, Submission, Submitted};
    let job = submission.job;
    // A job scheduled for later goes through the queue: no room is held.
    let later = job.schedule.run_at.is_some() || job.schedule.delay_ms.is_some_and(|d| d > 0);
    let reservation = handoff
        .filter(|_| !later)
        .and_then(|h| h.reserve(&job.workflow, job.workflow_version));
    let (store, job) = (store.clone(), job.clone());
    let (trace, owner, notify, limit) = (
        submission.trace,
        submission.owner,
        submission.notify_failures,
        submission.backlog_limit,
    );
    let submitting = actix_web::rt::spawn(async move {
        let mut reservation = reservation;
        let hand_to = reservation.as_mut().and_then(|r| r.hand_to(&job.id));
        let mut submission = Submission::new(&job)
            .traced(trace)
            .owned(owner, notify)
            .handed_to(hand_to);
        submission.backlog_limit = limit;
        let Submitted { intake, leased } = match store.jobs().submit(&submission).await {
            Ok(done) => done,
            Err(e) => {
                // The commit may have landed leased to this node.
                if let Some(reservation) = reservation {
                    reservation.orphaned();
                }
                return Err(e);
            }
        };
        match (reservation, leased) {
            (Some(reservation), Some(leased)) => reservation.adopt(leased).await?,
            // A job found rather than created, leased once and still
            // `received`, may be this very request's own row whose first
            // answer was lost (a failed batch is written again one by one).
            (Some(reservation), None) => {
                if let Intake::Existing(view) = &intake {
                    if view.attempts == 1
                        && view.state == crate::rules::lifecycle::JobState::Received
                    {
                        reservation.orphaned();
                    }
                }
            }
            (None, _) => {}
        }
        Ok::<_, StoreError>(intake)
    });
    submitting
        .await
        .unwrap_or_else(|e| Err(BatchError::Task(e).into()))
}
