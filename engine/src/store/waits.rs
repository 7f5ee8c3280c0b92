//! Durable waits and signals.
//!
//! A wait (`ctx.sleep`, `ctx.wait_for_signal`) is journaled under its key
//! with its due time the first time the body reaches it. While it is not
//! over, the attempt releases the job in the same commit: the row says what
//! it waits for (`waiting`) and when it may run again (`run_at`, the due
//! time), and no lease, actor or connection is held meanwhile. The
//! supervisor's acquire picks the job up when it is due like any scheduled
//! job; a signal of the awaited name makes it due at once and wakes the
//! nodes (`NOTIFY`). The body then replays to the wait, which takes the
//! oldest untaken signal of its name, or times out, and records its
//! outcome: a replay after that returns the outcome without waiting again.
//!
//! A signal is recorded once under its id; it is kept (untaken) when no
//! wait asks for it yet, and shown in the job's view.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl};
use serde::Serialize;
use serde_json::{json, Value};

use super::rows::NEW_JOB_CHANNEL;
use super::sql::sql;
use super::{Fence, Store};
use crate::error::StoreError;

use super::Waits;
pub use crate::rules::signal::{MAX_UNTAKEN_SIGNALS, MAX_UNTAKEN_SIGNAL_BYTES, SIGNALS_SHOWN};
pub use crate::rules::wait_machine::WaitKind;
use crate::rules::wait_machine::{
    decide, ApprovalCall, Decision, Seen, TakenSignal, WaitOutcome, Waiting,
};

/// When a wait is over at the latest.
#[derive(Debug, Clone, Copy)]
pub enum Until {
    /// This long after the wait was first reached (by the database's clock).
    After(std::time::Duration),
    /// At this time.
    At(DateTime<Utc>),
}

/// One wait as the body asks for it.
#[derive(Debug, Clone, Copy)]
pub struct WaitAsk<'a> {
    /// Its journal key (`job:{id}:sleep:{name}`, `job:{id}:signal:{name}`).
    pub key: &'a str,
    /// What it waits for.
    pub kind: WaitKind,
    /// The timer's or the signal's name.
    pub name: &'a str,
    /// When it is over at the latest (used the first time only).
    pub until: Until,
    /// An approval's tool call, shown in its `waiting`.
    pub tool: Option<&'a ApprovalCall>,
    /// An event to send once when the job starts waiting (an approval's
    /// `job.waiting`): its key and its outbox event (`keys::waiting`).
    pub event: Option<(&'a str, &'a str)>,
}

/// Where a wait stands.
#[derive(Debug, Clone, PartialEq)]
pub enum WaitStep {
    /// The wait is over, with its outcome as journaled.
    Done(WaitOutcome),
    /// Not over: the job is released until then (or a signal), in the same commit.
    Waiting {
        /// When it runs again at the latest.
        until: DateTime<Utc>,
        /// When `until` has passed by the database's clock, on this
        /// process's monotonic clock (what the node's wake-up is armed on:
        /// never before the database would call the wait due); `None` past
        /// what the clock can hold.
        due: Option<std::time::Instant>,
    },
    /// The attempt no longer holds the job: nothing was written.
    LeaseLost,
}

/// A signal as `GET /v1/jobs/{id}` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, QueryableByName, utoipa::ToSchema)]
pub struct SignalView {
    /// The signal's name (what a wait asks for).
    #[diesel(sql_type = Text)]
    pub name: String,
    /// The sender's id for it: the same id twice is one signal.
    #[diesel(sql_type = Text)]
    pub id: String,
    /// What it carries.
    #[diesel(sql_type = Jsonb)]
    #[schema(value_type = Object)]
    pub payload: Value,
    /// When it was recorded.
    #[diesel(sql_type = Timestamptz)]
    pub received_at: DateTime<Utc>,
    /// The wait that took it (its key), or `None` while it is kept.
    #[diesel(sql_type = Nullable<Text>)]
    pub taken_by: Option<String>,
}

/// What recording a signal did.
#[derive(Debug, Clone, PartialEq)]
pub enum SignalOutcome {
    /// Recorded now (`202`).
    Created(SignalView),
    /// The same id with the same payload was recorded before (`200`).
    Existing(SignalView),
    /// The same id with another payload (`409 signal_conflict`).
    Conflict,
    /// The job has finished: nothing was recorded (`409 job_finished`).
    Finished,
    /// Sent for one wait (its `until`), and the job does not wait for the
    /// name with that due time now: nothing was recorded (`409 not_waiting`).
    NotWaiting,
    /// Sent for one wait (its `until`), and that wait has its decision
    /// already (another signal sent for it, or one it will take first):
    /// nothing was recorded (`409 wait_decided`).
    Decided,
    /// The job holds as many untaken signals (or bytes of them) as it may:
    /// nothing was recorded (`409 too_many_signals`).
    TooMany,
    /// No such job (`404`).
    NotFound,
}

/// The wait a signal sent with `until` is for.
enum OpenWait {
    /// The job is not in a wait of that name and due time.
    None,
    /// It is, and that wait has its decision already.
    Decided,
    /// It is, undecided: the wait's key.
    Open(String),
}

/// A wait as journaled: its due time, its outcome once over, and whether
/// (and in how long) it is due by the database's clock.
#[derive(QueryableByName)]
pub(super) struct WaitRow {
    #[diesel(sql_type = Timestamptz)]
    pub(super) until: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    pub(super) outcome: Option<Value>,
    #[diesel(sql_type = Bool)]
    pub(super) due: bool,
    #[diesel(sql_type = BigInt)]
    pub(super) left_ms: i64,
}

/// Journals the wait `key` of job `job_id` the first time it is reached
/// (due `after_ms` from now, or `at`), and returns it as journaled.
pub(super) async fn journal_wait(
    conn: &mut diesel_async::AsyncPgConnection,
    job_id: &str,
    key: &str,
    kind: &str,
    name: &str,
    after_ms: Option<i64>,
    at: Option<DateTime<Utc>>,
) -> Result<WaitRow, StoreError> {
    Ok(sql(
        "INSERT INTO waits (job_id, wait_key, kind, name, until) \
         VALUES ($1, $2, $3, $4, coalesce($6, clock_timestamp() + $5 * interval '1 millisecond')) \
         ON CONFLICT (job_id, wait_key) DO UPDATE SET kind = waits.kind \
         RETURNING until, outcome, clock_timestamp() >= until AS due, \
             greatest(0, ceil(extract(epoch FROM until - clock_timestamp()) * 1000))::bigint AS left_ms",
    )
    .bind::<Text, _>(job_id)
    .bind::<Text, _>(key)
    .bind::<Text, _>(kind)
    .bind::<Text, _>(name)
    .bind::<Nullable<BigInt>, _>(after_ms)
    .bind::<Nullable<Timestamptz>, _>(at)
    .get_result(conn)
    .await?)
}

/// Records the wait's outcome (it is over), and clears the job's `waiting`.
pub(super) async fn close_wait(
    conn: &mut diesel_async::AsyncPgConnection,
    job_id: &str,
    key: &str,
    outcome: &WaitOutcome,
) -> Result<(), StoreError> {
    sql(
        "WITH done AS (UPDATE waits SET outcome = $3, done_at = now() \
             WHERE job_id = $1 AND wait_key = $2) \
         UPDATE jobs SET waiting = NULL WHERE id = $1 AND waiting IS NOT NULL",
    )
    .bind::<Text, _>(job_id)
    .bind::<Text, _>(key)
    .bind::<Jsonb, _>(outcome.to_json())
    .execute(conn)
    .await?;
    Ok(())
}

/// Lets the attempt's job go until `until`, showing `waiting`: no lease
/// (nor key slot) is held meanwhile. False when the lease is lost.
pub(super) async fn release_until(
    conn: &mut diesel_async::AsyncPgConnection,
    fence: &Fence,
    waiting: &Waiting,
    until: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let n = sql(
        "UPDATE jobs SET waiting = $3, run_at = $4, lease_owner = NULL, key_slot = NULL, \
             lease_expires_at = NULL, updated_at = now() \
         WHERE id = $1 AND lease_epoch = $2 AND finished_at IS NULL",
    )
    .bind::<Text, _>(&fence.job_id)
    .bind::<BigInt, _>(fence.epoch)
    .bind::<Jsonb, _>(waiting.to_json())
    .bind::<Timestamptz, _>(until)
    .execute(conn)
    .await?;
    Ok(n == 1)
}

/// A journaled outcome read back; one this machine cannot read is an
/// error (`invalid_data`), never a wait begun again.
pub(super) fn journaled_outcome(raw: Option<&Value>) -> Result<Option<WaitOutcome>, StoreError> {
    raw.map(|raw| {
        WaitOutcome::from_json(raw).ok_or_else(|| {
            StoreError::InvalidData(format!("a wait's outcome this node cannot read: {raw}"))
        })
    })
    .transpose()
}

/// The instant, on this process's monotonic clock, by which `left_ms` (the
/// time to a due time, by the database's clock, read by a statement that
/// has returned) has passed: the database cannot reach the due time sooner.
pub(crate) fn due_in(left_ms: i64) -> Option<std::time::Instant> {
    std::time::Instant::now().checked_add(std::time::Duration::from_millis(left_ms.max(0) as u64))
}

#[derive(QueryableByName)]
struct Taken {
    #[diesel(sql_type = Text)]
    signal_id: String,
    #[diesel(sql_type = Jsonb)]
    payload: Value,
}

#[derive(QueryableByName)]
struct JobRow {
    #[diesel(sql_type = Bool)]
    finished: bool,
}

impl Waits<'_> {
    /// Reaches the wait `ask` under the attempt's fence: journals it the
    /// first time, returns its outcome when it is over (taking the oldest
    /// untaken signal of its name, or timing out), or releases the job
    /// until it is due (see the module's documentation).
    pub async fn wait(self, fence: &Fence, ask: &WaitAsk<'_>) -> Result<WaitStep, StoreError> {
        retrying!(self, "wait", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(WaitStep::LeaseLost);
                }
                let (after_ms, at) = match ask.until {
                    Until::After(d) => (Some(i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)), None),
                    Until::At(at) => (None, Some(at)),
                };
                let row = journal_wait(conn, &fence.job_id, ask.key, ask.kind.as_str(), ask.name, after_ms, at)
                    .await?;
                // Journaled before: the machine returns it as it is (its
                // first rule), whatever this transaction would see.
                let journaled = journaled_outcome(row.outcome.as_ref())?;
                let replay = journaled.is_some();
                // The oldest signal of its name it may take (taken in this
                // transaction, kept only as the wait's outcome).
                let signal = if ask.kind.takes_signals() && !replay {
                        let taken: Vec<Taken> = sql(
                            "UPDATE signals SET taken_by = $2 \
                             WHERE (job_id, name, signal_id) = ( \
                                 SELECT job_id, name, signal_id FROM signals \
                                 WHERE job_id = $1 AND name = $3 AND taken_by IS NULL \
                                   AND (for_wait IS NULL OR for_wait = $2) \
                                 ORDER BY seq LIMIT 1 FOR UPDATE) \
                             RETURNING signal_id, payload",
                        )
                        .bind::<Text, _>(&fence.job_id)
                        .bind::<Text, _>(ask.key)
                        .bind::<Text, _>(ask.name)
                        .load(conn)
                        .await?;
                        taken.into_iter().next().map(|t| TakenSignal {
                            id: t.signal_id,
                            payload: t.payload,
                        })
                } else {
                    None
                };
                let seen = Seen {
                    signal,
                    children: None,
                    due: row.due,
                };
                match decide(ask.kind, journaled, seen) {
                    Decision::Over(outcome) => {
                        if !replay {
                            close_wait(conn, &fence.job_id, ask.key, &outcome).await?;
                        }
                        Ok(WaitStep::Done(outcome))
                    }
                    Decision::Wait => {
                        let (name, until) = (ask.name.to_owned(), row.until);
                        let waiting = match (ask.kind, ask.tool) {
                            (WaitKind::Approval, Some(tool)) => Waiting::Approval {
                                name,
                                until,
                                tool: tool.clone(),
                            },
                            (WaitKind::Signal | WaitKind::Approval, _) => {
                                Waiting::Signal { name, until }
                            }
                            _ => Waiting::Sleep { name, until },
                        };
                        if let Some((key, event)) = ask.event {
                            // Once per wait: the key is the event's identity,
                            // and the event's name (one row per job and
                            // event) is the wait's (`keys::waiting`).
                            // Announced on EVENTS_CHANNEL: any node sends it.
                            sql(
                                "WITH ev AS (INSERT INTO outbox (job_id, event, idempotency_key, url, body) \
                                 SELECT id, $3, $2, request->>'webhook_url', $4 \
                                 FROM jobs WHERE id = $1 AND request->>'webhook_url' <> '' \
                                 ON CONFLICT DO NOTHING RETURNING job_id) \
                                 SELECT pg_notify($5, job_id) FROM ev",
                            )
                            .bind::<Text, _>(&fence.job_id)
                            .bind::<Text, _>(key)
                            .bind::<Text, _>(event)
                            .bind::<Jsonb, _>(crate::rules::event::body(
                                "job.waiting",
                                json!({ "job_id": fence.job_id, "waiting": waiting.to_json() }),
                                chrono::Utc::now(),
                            ))
                            .bind::<Text, _>(super::events::EVENTS_CHANNEL)
                            .execute(conn)
                            .await?;
                        }
                        release_until(conn, fence, &waiting, row.until).await?;
                        Ok(WaitStep::Waiting {
                            until: row.until,
                            due: due_in(row.left_ms),
                        })
                    }
                }
            })
            .await
        })
        .await
    }

    /// Records `signal` of `name` for job `job_id` (once: the same id
    /// again is the same signal), and makes a job waiting for that name
    /// due at once, waking the nodes. The job's row is locked first, as a
    /// wait locks it, so a signal and a wait that reach the job at the same
    /// moment are ordered: either the wait takes the signal, or the signal
    /// finds the job waiting and wakes it. With `until`, the signal is for
    /// the wait due then alone: recorded only while the job waits for the
    /// signal (or approval) `name` with that due time and that wait has no
    /// decision yet, so a decision on a wait that is over is never kept for
    /// a later wait of the same name, and no other wait takes it.
    pub async fn signal(
        self,
        job_id: &str,
        name: &str,
        signal: &crate::rules::signal::SignalBody,
    ) -> Result<SignalOutcome, StoreError> {
        let (signal_id, payload, until) = (signal.id.as_str(), &signal.payload, signal.until);
        let hash = crate::request::canonical_hash(payload);
        retrying!(self, "signal", async || {
            let mut conn = self.db().conn().await?;
            let hash = hash.as_str();
            conn.transaction::<_, StoreError, _>(async move |conn| {
                let job: Vec<JobRow> = sql(
                    "SELECT finished_at IS NOT NULL AS finished FROM jobs WHERE id = $1 FOR NO KEY UPDATE",
                )
                .bind::<Text, _>(job_id)
                .load(conn)
                .await?;
                let Some(job) = job.into_iter().next() else {
                    return Ok(SignalOutcome::NotFound);
                };
                #[derive(QueryableByName)]
                struct Stored {
                    #[diesel(sql_type = Text)]
                    payload_hash: String,
                }
                let stored: Vec<Stored> = sql(
                    "SELECT payload_hash FROM signals WHERE job_id = $1 AND name = $2 AND signal_id = $3",
                )
                .bind::<Text, _>(job_id)
                .bind::<Text, _>(name)
                .bind::<Text, _>(signal_id)
                .load(conn)
                .await?;
                if let Some(stored) = stored.into_iter().next() {
                    if stored.payload_hash != hash {
                        return Ok(SignalOutcome::Conflict);
                    }
                    let view: SignalView = sql(concat!(
                        "SELECT name, signal_id AS id, payload, received_at, taken_by FROM signals ",
                        "WHERE job_id = $1 AND name = $2 AND signal_id = $3"
                    ))
                    .bind::<Text, _>(job_id)
                    .bind::<Text, _>(name)
                    .bind::<Text, _>(signal_id)
                    .get_result(conn)
                    .await?;
                    return Ok(SignalOutcome::Existing(view));
                }
                if job.finished {
                    return Ok(SignalOutcome::Finished);
                }
                // The wait this signal is for: it alone may take it.
                let mut for_wait = None;
                if let Some(until) = until {
                    match Store::open_wait(conn, job_id, name, until).await? {
                        OpenWait::None => return Ok(SignalOutcome::NotWaiting),
                        OpenWait::Decided => return Ok(SignalOutcome::Decided),
                        OpenWait::Open(key) => for_wait = Some(key),
                    }
                }
                #[derive(QueryableByName)]
                struct Held {
                    #[diesel(sql_type = BigInt)]
                    n: i64,
                    #[diesel(sql_type = BigInt)]
                    bytes: i64,
                }
                let held: Held = sql(
                    "SELECT count(*) AS n, coalesce(sum(octet_length(payload::text)), 0)::bigint AS bytes \
                     FROM signals WHERE job_id = $1 AND taken_by IS NULL",
                )
                .bind::<Text, _>(job_id)
                .get_result(conn)
                .await?;
                let adding = i64::try_from(payload.to_string().len()).unwrap_or(i64::MAX);
                if held.n >= MAX_UNTAKEN_SIGNALS
                    || held.bytes.saturating_add(adding) > MAX_UNTAKEN_SIGNAL_BYTES
                {
                    return Ok(SignalOutcome::TooMany);
                }
                let view: SignalView = sql(
                    "INSERT INTO signals (job_id, name, signal_id, payload, payload_hash, for_wait) \
                     VALUES ($1, $2, $3, $4, $5, $6) \
                     RETURNING name, signal_id AS id, payload, received_at, taken_by",
                )
                .bind::<Text, _>(job_id)
                .bind::<Text, _>(name)
                .bind::<Text, _>(signal_id)
                .bind::<Jsonb, _>(payload)
                .bind::<Text, _>(hash)
                .bind::<Nullable<Text>, _>(for_wait)
                .get_result(conn)
                .await?;
                // A job waiting for this name (and released) is due now.
                // Announced, as is a job already due and queued: an acquire
                // that met its row under this transaction's lock skipped it.
                sql(
                    "WITH woken AS (UPDATE jobs SET run_at = now(), updated_at = now() \
                         WHERE id = $1 AND finished_at IS NULL AND lease_owner IS NULL \
                           AND waiting->>'kind' IN ('signal', 'approval') AND waiting->>'name' = $2 \
                         RETURNING id) \
                     SELECT pg_notify($3, j.id) FROM jobs j \
                     WHERE j.id = $1 AND (EXISTS (SELECT 1 FROM woken) \
                         OR (j.finished_at IS NULL AND j.run_at <= now() \
                             AND (j.lease_expires_at IS NULL OR j.lease_expires_at < clock_timestamp())))",
                )
                .bind::<Text, _>(job_id)
                .bind::<Text, _>(name)
                .bind::<Text, _>(NEW_JOB_CHANNEL)
                .execute(conn)
                .await?;
                Ok(SignalOutcome::Created(view))
            })
            .await
        })
        .await
    }

    /// The latest [`SIGNALS_SHOWN`] signals of job `job_id`, oldest first
    /// (a wait loop may take any number of them over a job's life).
    pub async fn signals_of(self, job_id: &str) -> Result<Vec<SignalView>, StoreError> {
        let mut conn = self.db().conn().await?;
        Ok(
            sql("SELECT name, id, payload, received_at, taken_by FROM ( \
                 SELECT name, signal_id AS id, payload, received_at, taken_by, seq FROM signals \
                 WHERE job_id = $1 ORDER BY seq DESC LIMIT $2) latest ORDER BY seq")
            .bind::<Text, _>(job_id)
            .bind::<BigInt, _>(SIGNALS_SHOWN)
            .load(&mut conn)
            .await?,
        )
    }
}

impl Store {
    /// The wait of `name` due at `until` that job `job_id` is in now (its
    /// row locked by the caller), and whether it has its decision already:
    /// a signal sent for it, or an untaken signal of its name sent for no
    /// wait in particular, which it takes first.
    async fn open_wait(
        conn: &mut diesel_async::AsyncPgConnection,
        job_id: &str,
        name: &str,
        until: DateTime<Utc>,
    ) -> Result<OpenWait, StoreError> {
        #[derive(QueryableByName)]
        struct Open {
            #[diesel(sql_type = Text)]
            wait_key: String,
            #[diesel(sql_type = Bool)]
            decided: bool,
        }
        let open: Vec<Open> = sql(
            "SELECT w.wait_key, EXISTS ( \
                     SELECT 1 FROM signals s WHERE s.job_id = w.job_id AND s.name = w.name \
                       AND (s.for_wait = w.wait_key OR (s.for_wait IS NULL AND s.taken_by IS NULL))) AS decided \
             FROM jobs j JOIN waits w ON w.job_id = j.id \
             WHERE j.id = $1 AND j.waiting->>'kind' IN ('signal', 'approval') \
               AND j.waiting->>'name' = $2 AND (j.waiting->>'until')::timestamptz = $3 \
               AND w.name = $2 AND w.until = $3 AND w.outcome IS NULL \
               AND w.kind IN ('signal', 'approval')",
        )
        .bind::<Text, _>(job_id)
        .bind::<Text, _>(name)
        .bind::<Timestamptz, _>(until)
        .load(conn)
        .await?;
        Ok(match open.into_iter().next() {
            None => OpenWait::None,
            Some(o) if o.decided => OpenWait::Decided,
            Some(o) => OpenWait::Open(o.wait_key),
        })
    }
}
