//! Errors of the engine. One enum per concern, each keeping its `#[source]`;
//! retryability is decided exhaustively (no `_ =>` arm), so a new variant
//! forces a decision. What is stored in the database is the small
//! [`ErrorEnvelope`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Starting, initialising or reaching the embedded PostgreSQL.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// No `initdb`, `pg_ctl` and `postgres` were found to start a server with.
    #[error(
        "no PostgreSQL server binaries found (initdb, pg_ctl and postgres on PATH or under \
         /usr/lib/postgresql/*/bin). Install them (Debian/Ubuntu: `apt-get install postgresql`; \
         Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql`) or set \
         DATABASE_URL to an existing server"
    )]
    NoBinaries,
    /// Running as root, but the unprivileged service user PostgreSQL must run as does not exist.
    #[error(
        "running as root, PostgreSQL must run as the unprivileged user `{0}`, which does not \
         exist. Create it (`useradd --system {0}`) or set DATABASE_URL to an existing server"
    )]
    NoServiceUser(&'static str),
    /// The service user cannot traverse a folder on the way to the data directory.
    #[error(
        "PostgreSQL runs as the user `{user}`, which cannot enter {folder} (mode {mode:o}) on the \
         way to its data directory {data_dir}. Either put the data elsewhere \
         (e.g. ONCEFLOW_DATA_DIR=/var/tmp/onceflow) or let it pass through: `chmod o+x {folder}`"
    )]
    Unreachable {
        /// The service user PostgreSQL runs as.
        user: &'static str,
        /// The ancestor folder it cannot enter.
        folder: PathBuf,
        /// The data directory it was to reach.
        data_dir: PathBuf,
        /// The folder's permission bits.
        mode: u32,
    },
    /// A secret file or the data folder cannot be trusted (planted, foreign-owned, too open).
    #[error("refusing {path}: it {problem}. Fix: {fix}")]
    Unsafe {
        /// The path refused.
        path: PathBuf,
        /// What is wrong with it, as a clause (`has mode 644; others may read it`).
        problem: String,
        /// What the operator can do about it.
        fix: String,
    },
    /// A file operation on the data directory failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A PostgreSQL program (`initdb`, `pg_ctl`, …) could not be started.
    #[error("could not run {0}: {1}")]
    Spawn(String, #[source] std::io::Error),
    /// A PostgreSQL program ran and failed.
    #[error("{step} failed: {detail}")]
    Failed {
        /// What was being done (`initdb`, `pg_ctl start`, …).
        step: &'static str,
        /// Its exit status and output.
        detail: String,
    },
}

impl PgError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        PgError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Talking to Postgres.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A query failed.
    #[error("database query failed: {0}")]
    Query(#[from] diesel::result::Error),
    /// A connection could not be opened.
    #[error("could not connect to the database: {0}")]
    Connect(#[from] diesel::ConnectionError),
    /// No pooled connection could be had (timed out or broken).
    #[error("database pool: {0}")]
    Pool(#[from] bb8::RunError<diesel_async::pooled_connection::PoolError>),
    /// Running the schema migrations (or setting up the database for
    /// them) failed.
    /// It keeps the error itself (downcastable), and logs print its text.
    #[error("migrations failed: {0}")]
    Migrate(Box<dyn std::error::Error + Send + Sync>),
    /// The group commit could not answer a write (see [`BatchError`]).
    #[error("batched write: {0}")]
    Batch(#[from] BatchError),
    /// Data PostgreSQL would reject (a NUL character, a negative count),
    /// caught before it was written: permanent for that job alone.
    #[error("invalid data: {0}")]
    InvalidData(String),
}

/// Why the group commit could not answer a write.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The statement returned another number of outcomes than it was sent rows.
    #[error("a batch of {sent} returned {got} outcomes")]
    Miscounted {
        /// Rows sent.
        sent: usize,
        /// Outcomes returned.
        got: usize,
    },
    /// The batching task has stopped (the store is shutting down).
    #[error("the batching task is gone")]
    Gone,
    /// The batching task dropped the request without an answer.
    #[error("the batching task dropped the request")]
    Dropped,
    /// The task that carried the write failed (its panic, if it panicked).
    #[error("the write's task failed: {0}")]
    Task(tokio::task::JoinError),
    /// A probe's transaction, rolled back on purpose.
    #[error("the probe rolled back")]
    ProbeRolledBack,
    /// A batched read failed as a whole: each of its requests gets the
    /// batch's error, as text, and whether it was transient.
    #[error("{message}")]
    Failed {
        /// The batch's error.
        message: String,
        /// [`StoreError::is_retryable`] of the batch's error.
        retryable: bool,
    },
}

impl StoreError {
    /// Whether the same statement may succeed if run again: the database said
    /// something transient. Decided by what PostgreSQL reported, never by its
    /// English message text.
    ///
    /// Transient: connection loss (class 08: the driver reports it as a
    /// command it could not send or a closed connection), pool timeouts,
    /// 40001 (serialization failure) and 25006 (read-only, after a
    /// failover). diesel-async maps only a few SQLSTATEs to error kinds and
    /// folds the rest — 40P01 (deadlock), 57P01/57P02/57P03 (terminated
    /// backend, crash shutdown, cannot connect now), 53300 (too many
    /// connections), 55P03 (lock not available) among them — into
    /// `Unknown`, with the code out of reach; so `Unknown` is transient too.
    /// Retrying any of these is safe because every write is fenced by the
    /// lease epoch. Constraint violations are permanent: the data is wrong.
    pub fn is_retryable(&self) -> bool {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        match self {
            StoreError::Batch(BatchError::Failed { retryable, .. }) => *retryable,
            StoreError::Connect(_) | StoreError::Pool(_) | StoreError::Batch(_) => true,
            StoreError::Migrate(_) | StoreError::InvalidData(_) => false,
            StoreError::Query(e) => match e {
                E::DatabaseError(kind, _) => match kind {
                    K::SerializationFailure
                    | K::UnableToSendCommand
                    | K::ClosedConnection
                    | K::ReadOnlyTransaction
                    | K::Unknown => true,
                    K::UniqueViolation
                    | K::ForeignKeyViolation
                    | K::NotNullViolation
                    | K::CheckViolation
                    | K::RestrictViolation
                    | K::ExclusionViolation => false,
                    // DatabaseErrorKind is non-exhaustive upstream; a kind
                    // added later is a code diesel learnt to name, and the
                    // fenced statement is safe to run again.
                    _ => true,
                },
                E::BrokenTransactionManager => true,
                E::NotFound
                | E::InvalidCString(_)
                | E::QueryBuilderError(_)
                | E::DeserializationError(_)
                | E::SerializationError(_)
                | E::RollbackErrorOnCommit { .. }
                | E::RollbackTransaction
                | E::AlreadyInTransaction
                | E::NotInTransaction
                | E::IntegerConversion(_) => false,
                // diesel::result::Error is non-exhaustive upstream.
                _ => false,
            },
        }
    }
}

/// The failure record stored with a job, a model call or an outbox row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorEnvelope {
    /// A stable, machine-readable code (`http_503`, `ambiguous`, `lease_lost`, …).
    pub code: String,
    /// A human-readable description.
    pub message: String,
    /// Whether the failure was judged transient (worth retrying).
    pub retryable: bool,
}

/// Why a step of a job's run did not complete.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Another attempt owns the job (the epoch moved on): stop, write nothing.
    #[error("lease lost")]
    LeaseLost,
    /// The node is draining: stop before the next side effect starts; the
    /// engine releases the lease and another node resumes the job.
    #[error("the node is draining")]
    Draining,
    /// A failpoint crashed the attempt: stop on the spot, keep the lease until it expires.
    #[error("{0}")]
    Injected(#[from] crate::faults::Injected),
    /// Transient: run the job again after a backoff. `attempt` counts the sends
    /// spent so far on this step (the retry budget; inside `ctx.step` the
    /// engine counts it in the journal, whatever the work reported),
    /// `retry_after` is the server's own request.
    #[error("{}", error.message)]
    Retry {
        /// The failure, as stored with the job.
        error: ErrorEnvelope,
        /// Sends spent so far on this step.
        attempt: u32,
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<std::time::Duration>,
    },
    /// Permanent: the job goes to `dead` with this reason.
    #[error("{reason}: {}", error.message)]
    Permanent {
        /// The job's dead reason.
        reason: String,
        /// The failure, as stored with the job.
        error: ErrorEnvelope,
    },
    /// The stored input no longer matches the workflow's input type.
    #[error("invalid input: {0}")]
    InvalidInput(InvalidInput),
    /// The workflow's output could not be serialised.
    #[error("cannot serialise the output: {0}")]
    Serialize(String),
    /// The database failed; retried as [`StoreError::is_retryable`] decides.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The body reached a wait that is not over (a timer not due, a signal
    /// not sent): the wait is journaled and the job released until it is
    /// due, in one commit. Not a failure: pass it on with `?`, and the job
    /// resumes at the wait when its time comes or its signal arrives.
    #[error("waiting for {kind} {name:?} until {until}")]
    Waiting {
        /// `sleep`, `signal`, `approval`, `children`, `budget` or `provider`.
        kind: &'static str,
        /// The timer's or the signal's name.
        name: String,
        /// When the job runs again at the latest.
        until: chrono::DateTime<chrono::Utc>,
        /// When `until` has passed by the database's clock, on this
        /// process's monotonic clock: when the node that released the job
        /// looks for it again (`None` past what the clock can hold).
        due: Option<std::time::Instant>,
    },
}

impl StepError {
    pub(crate) fn invalid_input(e: InvalidInput) -> Self {
        StepError::InvalidInput(e)
    }

    /// A permanent failure with a code and message.
    pub fn permanent(code: &str, reason: impl Into<String>, message: impl Into<String>) -> Self {
        StepError::Permanent {
            reason: reason.into(),
            error: ErrorEnvelope {
                code: code.to_owned(),
                message: message.into(),
                retryable: false,
            },
        }
    }

    /// Whether running the job again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StepError::Retry { .. } => true,
            StepError::Injected(crate::faults::Injected::Fail(_)) => true,
            StepError::Injected(crate::faults::Injected::Crash(_)) => false,
            StepError::Store(e) => e.is_retryable(),
            StepError::LeaseLost
            | StepError::Draining
            | StepError::Permanent { .. }
            | StepError::InvalidInput(_)
            | StepError::Serialize(_)
            | StepError::Waiting { .. } => false,
        }
    }

    /// The envelope stored with the job. The job's owner reads it (`GET
    /// /v1/jobs/{id}`, the `job.dead` webhook), so a database failure is
    /// named, never quoted: PostgreSQL's message can name tables,
    /// constraints and values. The node logs the whole error where it
    /// retries or kills the job.
    pub fn envelope(&self) -> ErrorEnvelope {
        match self {
            StepError::Retry { error, .. } | StepError::Permanent { error, .. } => error.clone(),
            StepError::Store(e) => ErrorEnvelope {
                code: "store".to_owned(),
                message: if e.is_retryable() {
                    "a database statement failed; the node's log has the details".to_owned()
                } else {
                    "the database refused a statement; the node's log has the details".to_owned()
                },
                retryable: e.is_retryable(),
            },
            other => ErrorEnvelope {
                code: match other {
                    StepError::LeaseLost => "lease_lost",
                    StepError::Draining => "draining",
                    StepError::Injected(_) => "injected",
                    StepError::InvalidInput(_) => "invalid_input",
                    StepError::Serialize(_) => "serialize",
                    StepError::Waiting { .. } => "waiting",
                    StepError::Store(_) | StepError::Retry { .. } | StepError::Permanent { .. } => {
                        unreachable!("matched above")
                    }
                }
                .to_owned(),
                message: other.to_string(),
                retryable: other.is_retryable(),
            },
        }
    }
}

/// A workflow's input failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidInput {
    /// The offending field, as a dotted path from the request root (`input.messages`).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl InvalidInput {
    /// `field` (a dotted path, e.g. `input.messages`) failed because of `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidInput {
            field: field.into(),
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_failure_is_named_not_quoted_to_the_jobs_owner() {
        let secret = "duplicate key value violates unique constraint \"outbox_pkey\"";
        for e in [
            StoreError::Migrate(secret.into()),
            StoreError::InvalidData(secret.into()),
            // Retryable: PostgreSQL's own words travel in the error.
            StoreError::Query(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::Unknown,
                Box::new(secret.to_owned()),
            )),
        ] {
            let retryable = e.is_retryable();
            let step = StepError::Store(e);
            let envelope = step.envelope();
            assert_eq!(envelope.code, "store");
            assert_eq!(envelope.retryable, retryable);
            assert!(!envelope.message.contains("outbox_pkey"), "{envelope:?}");
            // The log line keeps it.
            assert!(step.to_string().contains("outbox_pkey"));
        }
    }

    /// One row per SQLSTATE class PostgreSQL reports, as diesel names it
    /// (the kinds diesel does not name arrive as `Unknown`).
    #[test]
    fn store_errors_retry_by_sqlstate_class() {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        let db = |kind| StoreError::Query(E::DatabaseError(kind, Box::new(String::from("x"))));
        for (sqlstate, kind, retryable) in [
            ("08xxx connection exception", K::ClosedConnection, true),
            ("08xxx, sending", K::UnableToSendCommand, true),
            ("40001 serialization_failure", K::SerializationFailure, true),
            ("40P01 deadlock_detected (Unknown)", K::Unknown, true),
            (
                "25006 read_only_sql_transaction (a demoted primary)",
                K::ReadOnlyTransaction,
                true,
            ),
            ("57P01 admin_shutdown (Unknown)", K::Unknown, true),
            ("53xxx insufficient_resources (Unknown)", K::Unknown, true),
            ("23505 unique_violation", K::UniqueViolation, false),
            ("23503 foreign_key_violation", K::ForeignKeyViolation, false),
            ("23502 not_null_violation", K::NotNullViolation, false),
            ("23514 check_violation", K::CheckViolation, false),
            ("23001 restrict_violation", K::RestrictViolation, false),
            ("23P01 exclusion_violation", K::ExclusionViolation, false),
        ] {
            assert_eq!(db(kind).is_retryable(), retryable, "{sqlstate}");
        }
        // Not from PostgreSQL: the pool and the group commit retry, a
        // statement diesel could not build or read does not.
        assert!(StoreError::Batch(BatchError::Gone).is_retryable());
        assert!(StoreError::Query(E::BrokenTransactionManager).is_retryable());
        for e in [
            StoreError::Query(E::NotFound),
            StoreError::Query(E::RollbackTransaction),
            StoreError::Migrate("x".into()),
            StoreError::InvalidData("x".into()),
        ] {
            assert!(!e.is_retryable(), "{e:?}");
        }
    }
}
