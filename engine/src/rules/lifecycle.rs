//! The job lifecycle: one enum, one pure decision function.
//!
//! ```text
//! received → generated → persisted → claimed → delivered → acked
//!     \__________ any step may end in ____________/→ dead ─(redrive)→ its last live state
//!     \__________ an operator may end any in ______/→ cancelled
//! ```
//!
//! [`next_step`] decides what to do after a checkpoint with no I/O; the job
//! actor carries the effect out. `LIFECYCLE.md` beside this crate lists each
//! transition's guard and which invariants the schema enforces.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a job is. Persisted as the Postgres enum `job_state`; the names are
/// a contract and are never reordered, renamed or reused.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Entered at intake (`POST /v1/jobs`). Durable: the job row and its request.
    /// Moved out by the job actor once the workflow body returned.
    Received,
    /// The workflow body finished; every model call it made is journaled, so a
    /// rerun of the body replays from the journal. Moved out by `persist`.
    Generated,
    /// The result row is written (one per job). A retry loads it, never
    /// regenerates. Moved out by claiming the completion notification.
    Persisted,
    /// The outbox row `job:{id}:completed` is claimed. Moved out when the
    /// webhook returns 2xx (or to `dead` on a permanent failure / unknown outcome).
    Claimed,
    /// The webhook got a 2xx and the outbox row is marked delivered. Moved out by the ack.
    Delivered,
    /// Finished; out of the runnable set. Terminal (purged after retention).
    Acked,
    /// A permanent failure, kept with its reason. Terminal until re-driven:
    /// `Jobs::redrive` moves it back to the last live state it reached.
    Dead,
    /// An operator cancelled it (`Jobs::cancel`, from any live state). Final:
    /// the cancel bumps the lease epoch, so an attempt still running records
    /// nothing more and starts no new side effect.
    Cancelled,
}

impl JobState {
    /// Every state, in lifecycle order.
    pub const ALL: [JobState; 8] = [
        JobState::Received,
        JobState::Generated,
        JobState::Persisted,
        JobState::Claimed,
        JobState::Delivered,
        JobState::Acked,
        JobState::Dead,
        JobState::Cancelled,
    ];

    /// The name stored in Postgres.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Received => "received",
            JobState::Generated => "generated",
            JobState::Persisted => "persisted",
            JobState::Claimed => "claimed",
            JobState::Delivered => "delivered",
            JobState::Acked => "acked",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Acked, dead and cancelled jobs are no longer runnable.
    pub const fn is_terminal(self) -> bool {
        match self {
            JobState::Acked | JobState::Dead | JobState::Cancelled => true,
            JobState::Received
            | JobState::Generated
            | JobState::Persisted
            | JobState::Claimed
            | JobState::Delivered => false,
        }
    }

    /// The state the happy path moves to from here.
    pub const fn successor(self) -> Option<JobState> {
        match self {
            JobState::Received => Some(JobState::Generated),
            JobState::Generated => Some(JobState::Persisted),
            JobState::Persisted => Some(JobState::Claimed),
            JobState::Claimed => Some(JobState::Delivered),
            JobState::Delivered => Some(JobState::Acked),
            JobState::Acked | JobState::Dead | JobState::Cancelled => None,
        }
    }

    /// Whether `self → to` is a transition of the lifecycle (a redrive,
    /// `dead →` a live state, is the operator's and checked by `Jobs::redrive`).
    pub fn can_move_to(self, to: JobState) -> bool {
        (matches!(to, JobState::Dead | JobState::Cancelled) && !self.is_terminal())
            || self.successor() == Some(to)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown state name read from the database.
#[derive(Debug, thiserror::Error)]
#[error("unknown job state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for JobState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// What the actor does next, decided from the last checkpoint alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Run the workflow body (it replays journaled calls), then commit
    /// `generated`, `persisted` and `claimed` together (`Journal::commit_result`).
    RunBody,
    /// Replay the body from the journal, then commit `persisted` and `claimed`.
    Persist,
    /// Load the result row, then commit `claimed`.
    Claim,
    /// POST the webhook; on 2xx mark delivered and checkpoint `delivered`.
    Deliver,
    /// Checkpoint `acked` and release the lease.
    Ack,
    /// Nothing left to do.
    Done,
}

/// The pure transition function: the next step after a checkpoint in `state`.
pub const fn next_step(state: JobState) -> Step {
    match state {
        JobState::Received => Step::RunBody,
        JobState::Generated => Step::Persist,
        JobState::Persisted => Step::Claim,
        JobState::Claimed => Step::Deliver,
        JobState::Delivered => Step::Ack,
        JobState::Acked | JobState::Dead | JobState::Cancelled => Step::Done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for st in JobState::ALL {
            assert_eq!(st.as_str().parse::<JobState>().unwrap(), st);
            assert_eq!(serde_json::to_value(st).unwrap(), st.as_str());
        }
        assert!("running".parse::<JobState>().is_err());
    }

    #[test]
    fn the_happy_path_visits_every_live_state_once() {
        let mut path = vec![JobState::Received];
        while let Some(next) = path.last().unwrap().successor() {
            path.push(next);
        }
        assert_eq!(path, JobState::ALL[..6]);
    }

    #[test]
    fn dead_and_cancelled_are_reachable_from_every_live_state_only() {
        for st in JobState::ALL {
            assert_eq!(st.can_move_to(JobState::Dead), !st.is_terminal(), "{st}");
            assert_eq!(
                st.can_move_to(JobState::Cancelled),
                !st.is_terminal(),
                "{st}"
            );
        }
        assert!(!JobState::Received.can_move_to(JobState::Persisted));
        assert!(!JobState::Acked.can_move_to(JobState::Received));
    }

    #[test]
    fn next_step_follows_the_checkpoint() {
        assert_eq!(next_step(JobState::Received), Step::RunBody);
        assert_eq!(next_step(JobState::Generated), Step::Persist);
        assert_eq!(next_step(JobState::Persisted), Step::Claim);
        assert_eq!(next_step(JobState::Claimed), Step::Deliver);
        assert_eq!(next_step(JobState::Delivered), Step::Ack);
        assert_eq!(next_step(JobState::Acked), Step::Done);
        assert_eq!(next_step(JobState::Dead), Step::Done);
        assert_eq!(next_step(JobState::Cancelled), Step::Done);
    }
}
