//! All SQL lives here. Actors, workflows and the API call intention-revealing
//! methods; every transition is one guarded statement committed together with
//! its history row and the data it depends on.
//!
//! The store is reached by noun: `store.jobs().cancel(…)`,
//! `store.tokens().create(…)`. Each noun is a borrowed view of the one
//! [`Store`] (its pool, its batches, its retry budget):
//!
//! | noun | what it acts on | files |
//! |---|---|---|
//! | [`Jobs`] | intake (one [`Submission`]), the job view and list, an operator's cancel and redrive | `jobs`, `operate` |
//! | [`Leases`] | taking runnable jobs, heartbeats, releases, node names | `lease` |
//! | [`Journal`] | model calls, results, the webhook outbox, the tool ledger, steps, streamed answers | `journal`, `ledger`, `streams` |
//! | [`Waits`] | durable waits, signals, children and joins, model-token budgets | `waits`, `children`, `budgets` |
//! | [`Schedules`] | schedules and their firing | `schedules` |
//! | [`Events`] | failure events (`job.dead`, `job.cancelled`) and a job's events for watchers | `events`, `streams` |
//! | [`Tokens`] | API tokens (stored hashed), their shares, development mode | `tokens` |
//! | [`Limits`] | provider slots and windows (the rows behind [`crate::rules::quota`]) | `slots` |
//! | [`Retention`] | purges of finished jobs and the counts behind the gauges | `ledger` |
//! | [`GroupCommit`] | group commit's seams for tests and benchmarks (holds, depths, batch sizes) | `group_writes` |
//!
//! [`Store`] itself keeps what every noun shares: the pool, the retry
//! budget (`retrying!`) and health.
//!
//! * [`sql`](mod@sql): hand-written statements whose prepared form is cached.
//! * `rows`: what the modules share (the checkpoint outcome, the lock order).
//! * `group_commit`: group commit — one statement and one commit for the
//!   writes of many actors; `group_writes`: the writes it carries
//!   (`delivered`, `acked`, model answers, intake).

/// Runs a statement until it succeeds, fails permanently, or the store's
/// retry budget is spent, backing off (10 ms doubling to 1 s, with jitter)
/// after each transient failure:
/// `retrying!(self, "what", async || { … }).await`.
///
/// Every write is fenced by the lease epoch, so running one again is safe:
/// if the lease was lost meanwhile, the write answers `LeaseLost` instead
/// of writing. This is what keeps a recorded outcome from being redone: an
/// attempt whose 2xx could not be recorded on the first try records it on
/// the next, instead of leaving its in-flight mark for another attempt to
/// treat as never sent.
macro_rules! retrying {
    ($store:expr, $what:literal, async || $body:block) => {
        async {
            let mut retry = $store.retry($what);
            loop {
                match async $body.await {
                    Err(e) if retry.again(&e) => retry.wait().await,
                    other => break other,
                }
            }
        }
    };
}

pub mod budgets;
pub mod children;
pub mod events;
mod group_commit;
pub(crate) mod group_writes;
pub mod jobs;
pub mod journal;
pub mod lease;
pub mod ledger;
pub mod operate;
mod rows;
pub mod schedules;
pub mod slots;
pub mod sql;
pub mod streams;
pub mod tokens;
pub mod waits;

use std::time::{Duration, Instant};

use diesel::sql_types::{Integer, Text};
use diesel_async::RunQueryDsl;
use sql::sql;

use crate::db::Db;
use crate::error::StoreError;

pub use group_writes::{BatchKind, Held};
pub use jobs::{
    DeliveryView, HistoryEntry, Intake, JobSummary, JobView, ListFilter, Submission, Submitted,
    COMPUTED_WAIT_KINDS,
};
pub use lease::{Checkpoint, Fence, Leased, NodeIdHold, Renewal};
pub use ledger::Journaled;
pub use rows::Channel;

/// The Postgres store.
#[derive(Debug, Clone)]
pub struct Store {
    db: Db,
    batches: std::sync::Arc<group_writes::Batches>,
    retry_budget: Duration,
    /// Statements run again in place after a transient failure.
    retried: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Reads of a job's events for its watchers (since this store was made).
    event_reads: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// The nouns of the store: each a borrowed view of the [`Store`] whose
/// methods act on that one thing (see the module's table).
macro_rules! nouns {
    ($($(#[$doc:meta])* $noun:ident => $accessor:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $noun<'a>(&'a Store);

        impl std::ops::Deref for $noun<'_> {
            type Target = Store;
            fn deref(&self) -> &Store {
                self.0
            }
        }

        impl Store {
            $(#[$doc])*
            pub fn $accessor(&self) -> $noun<'_> {
                $noun(self)
            }
        }
    )*};
}

nouns! {
    /// Jobs: intake, the job view and list, cancel and redrive.
    Jobs => jobs;
    /// Leases: taking runnable jobs, heartbeats, releases, node names.
    Leases => leases;
    /// The journal: model calls, results, the outbox, tools, steps, streamed answers.
    Journal => journal;
    /// Waits: timers, signals, children and joins, budgets.
    Waits => waits;
    /// Schedules and their firing.
    Schedules => schedules;
    /// Failure events and a job's events for watchers.
    Events => events;
    /// API tokens, their shares, development mode.
    Tokens => tokens;
    /// Provider slots and windows.
    Limits => limits;
    /// Retention: purges and the counts behind the gauges.
    Retention => retention;
    /// Group commit's seams: holds, queue depths and batch sizes, for tests
    /// and benchmarks.
    GroupCommit => group_commit;
}

/// How long a statement that failed transiently is retried in place by default.
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(30);

impl Store {
    /// A store on `db`; starts its batching tasks on the database runtime.
    pub fn new(db: Db) -> Self {
        let batches = group_writes::Batches::start(&db);
        Store {
            db,
            batches,
            retry_budget: DEFAULT_RETRY_BUDGET,
            retried: Default::default(),
            event_reads: Default::default(),
        }
    }

    /// How long a statement that failed transiently (a lost connection, a
    /// serialization failure, a deadlock, a terminated backend, a pool
    /// timeout) is run again in place before the error reaches the caller.
    pub fn with_retry_budget(mut self, budget: Duration) -> Self {
        self.retry_budget = budget;
        self
    }

    /// How many times watchers read a job's events from the database (an
    /// idle stream reads nothing).
    pub fn event_reads(&self) -> u64 {
        std::sync::atomic::AtomicU64::load(&self.event_reads, std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times a statement was run again in place after a transient
    /// failure (since this store was made).
    pub fn statements_retried(&self) -> u64 {
        std::sync::atomic::AtomicU64::load(&self.retried, std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts the in-place retries of one statement (see [`retrying!`]).
    pub(crate) fn retry(&self, what: &'static str) -> Retry {
        Retry {
            counter: self.retried.clone(),
            what,
            budget: self.retry_budget,
            started: Instant::now(),
            backoff: Duration::from_millis(10),
            tries: 1,
        }
    }

    /// The connection pool underneath.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// True when the database answers and the schema is migrated.
    pub async fn healthy(&self) -> Result<bool, StoreError> {
        #[derive(diesel::QueryableByName)]
        struct Found {
            #[diesel(sql_type = Integer)]
            n: i32,
        }
        let mut conn = self.db.conn().await?;
        let found: Found =
            sql("SELECT count(*)::int AS n FROM pg_catalog.pg_tables WHERE tablename = $1")
                .bind::<Text, _>("jobs")
                .get_result(&mut conn)
                .await?;
        Ok(found.n == 1)
    }
}

/// The in-place retries of one statement.
#[derive(Debug)]
pub(crate) struct Retry {
    counter: std::sync::Arc<std::sync::atomic::AtomicU64>,
    what: &'static str,
    budget: Duration,
    started: Instant,
    backoff: Duration,
    tries: u32,
}

impl Retry {
    /// Whether to run the statement again after `e`.
    pub(crate) fn again(&self, e: &StoreError) -> bool {
        let again = e.is_retryable() && self.started.elapsed() < self.budget;
        if again {
            tracing::warn!(statement = self.what, tries = self.tries, error = %e, "transient database error; running the statement again");
        }
        again
    }

    /// Waits before the next try.
    pub(crate) async fn wait(&mut self) {
        let left = self.budget.saturating_sub(self.started.elapsed());
        let wait = self
            .backoff
            .mul_f64(0.5 + rand::random::<f64>() * 0.5)
            .min(left);
        tokio::time::sleep(wait).await;
        self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
        self.tries += 1;
        self.counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}
