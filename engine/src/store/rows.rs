//! What the store's modules share, below all of them: the channel and the
//! worker name of intake, the outcome of a guarded transition, the lock
//! order of statements over many jobs, and small row types.

use diesel::sql_types::Text;
use diesel::QueryableByName;

use crate::error::StoreError;
use crate::rules::lifecycle::JobState;

/// The `NOTIFY` channels the store announces on, each with what a node
/// does when it hears one (`runtime` listens to all and matches them
/// exhaustively). The payload is a job id unless said otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// A job became runnable (new, due, woken by a signal): poll.
    NewJob,
    /// A provider limit's slot or tokens came free (payload: the limit).
    Limits,
    /// A stream moved (payload: the job id): wake its watchers.
    Stream,
    /// A job was cancelled: stop its attempt here, if any.
    Cancelled,
    /// A schedule was created or resumed: look for due schedules.
    Schedules,
    /// A token changed (payload: its id): drop what was cached of it.
    Tokens,
    /// An event was queued by SQL: send the due events.
    Events,
}

impl Channel {
    /// Every channel, as `LISTEN` takes them.
    pub const ALL: [Channel; 7] = [
        Channel::NewJob,
        Channel::Limits,
        Channel::Stream,
        Channel::Cancelled,
        Channel::Schedules,
        Channel::Tokens,
        Channel::Events,
    ];

    /// The channel's name in PostgreSQL.
    pub const fn name(self) -> &'static str {
        match self {
            Channel::NewJob => "onceflow_new_job",
            Channel::Limits => "onceflow_limits",
            Channel::Stream => "onceflow_stream",
            Channel::Cancelled => "onceflow_cancelled",
            Channel::Schedules => "onceflow_schedules",
            Channel::Tokens => "onceflow_tokens",
            Channel::Events => "onceflow_events",
        }
    }

    /// The channel named `name`, if it is one of ours.
    pub fn parse(name: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// The channel new jobs are announced on (payload: the job id).
pub const NEW_JOB_CHANNEL: &str = Channel::NewJob.name();

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
    s.parse()
        .map_err(|e: crate::rules::lifecycle::UnknownState| {
            StoreError::Query(diesel::result::Error::DeserializationError(e.into()))
        })
}
