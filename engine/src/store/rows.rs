//! What the store's modules share, below all of them: the channel and the
//! worker name of intake, the outcome of a guarded transition, the lock
//! order of statements over many jobs, and small row types.

use diesel::sql_types::Text;
use diesel::QueryableByName;

use crate::error::StoreError;
use crate::lifecycle::JobState;

/// The channel new jobs are announced on (payload: the job id).
pub const NEW_JOB_CHANNEL: &str = "onceflow_new_job";

/// The worker name recorded on the intake history row.
pub const INTAKE_WORKER: &str = "intake";

/// The outcome of a guarded transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpoint {
    /// The row moved and the history row is written.
    Moved,
    /// Another attempt owns the job now (the epoch moved on): stop, write nothing.
    LeaseLost,
    /// The job is not in the expected state any more (a concurrent attempt
    /// with the same lease got there first): continue from `JobState`.
    AlreadyAt(JobState),
    /// A failpoint aborted the transaction before it committed (test seam):
    /// nothing was written; the attempt stops as if it crashed.
    Faulted,
}

/// The job-row locks a statement over many jobs takes first, in id order
/// (`$ids` is the array of job ids), as a `locked` CTE. PostgreSQL reads a CTE
/// lazily, so a `locked` read only through `EXISTS` would lock its first row
/// alone; every user reads it whole with `(SELECT count(*) FROM locked)`, a
/// one-time filter evaluated before the statement touches any row. Its
/// `lease_epoch` is the row's latest committed version (a locking read
/// re-reads a row updated meanwhile), unlike a plain join on `jobs`, which
/// sees the statement's snapshot: a fence that is not an `UPDATE`'s own
/// `WHERE` must compare against `locked.lease_epoch`. The array is read
/// through a sub-select, as every batch array is (see [`group_writes`]), so the
/// statement's cached generic plan is used at every batch size.
///
/// [`group_writes`]: super::group_writes
macro_rules! lock_in_order {
    ($ids:literal) => {
        concat!(
            "locked AS MATERIALIZED (SELECT id, lease_epoch FROM jobs WHERE id = ANY((SELECT ",
            $ids,
            "::text[])::text[]) ORDER BY id FOR NO KEY UPDATE) "
        )
    };
}
pub(crate) use lock_in_order;

#[derive(QueryableByName)]
pub(crate) struct IdRow {
    #[diesel(sql_type = Text)]
    pub(crate) id: String,
}

pub(crate) fn parse_state(s: &str) -> Result<JobState, StoreError> {
    s.parse().map_err(|e: crate::lifecycle::UnknownState| {
        StoreError::Query(diesel::result::Error::DeserializationError(e.into()))
    })
}
