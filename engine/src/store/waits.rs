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

/// What a job waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// A timer (`ctx.sleep`, `ctx.sleep_until`).
    Sleep,
    /// A signal of a name, with a timeout (`ctx.wait_for_signal`).
    Signal,
    /// A person's decision on a tool call: a signal named `approval:{tool_call_id}`.
    Approval,
}

impl WaitKind {
    /// The name stored and shown (`"waiting": {"kind": …}`).
    pub fn as_str(self) -> &'static str {
        match self {
            WaitKind::Sleep => "sleep",
            WaitKind::Signal => "signal",
            WaitKind::Approval => "approval",
        }
    }
}

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
    /// More to show in `waiting` (an approval's tool call).
    pub detail: Option<&'a Value>,
    /// An event to send once when the job starts waiting (an approval's
    /// `job.waiting`): its key and its outbox event (`keys::waiting`).
    pub event: Option<(&'a str, &'a str)>,
}

/// Where a wait stands.
#[derive(Debug, Clone, PartialEq)]
pub enum WaitStep {
    /// The wait is over: `{"slept": true}`, `{"signal": {"id", "payload"}}`
    /// or `{"timeout": true}`, as journaled.
    Done(Value),
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
    /// No such job (`404`).
    NotFound,
}

#[derive(QueryableByName)]
struct WaitRow {
    #[diesel(sql_type = Timestamptz)]
    until: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    outcome: Option<Value>,
    #[diesel(sql_type = Bool)]
    due: bool,
    #[diesel(sql_type = BigInt)]
    left_ms: i64,
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

impl Store {
    /// Reaches the wait `ask` under the attempt's fence: journals it the
    /// first time, returns its outcome when it is over (taking the oldest
    /// untaken signal of its name, or timing out), or releases the job
    /// until it is due (see the module's documentation).
    pub async fn wait(&self, fence: &Fence, ask: &WaitAsk<'_>) -> Result<WaitStep, StoreError> {
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
                let row: WaitRow = sql(
                    "INSERT INTO waits (job_id, wait_key, kind, name, until) \
                     VALUES ($1, $2, $3, $4, coalesce($6, clock_timestamp() + $5 * interval '1 millisecond')) \
                     ON CONFLICT (job_id, wait_key) DO UPDATE SET kind = waits.kind \
                     RETURNING until, outcome, clock_timestamp() >= until AS due, \
                         greatest(0, ceil(extract(epoch FROM until - clock_timestamp()) * 1000))::bigint AS left_ms",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Text, _>(ask.key)
                .bind::<Text, _>(ask.kind.as_str())
                .bind::<Text, _>(ask.name)
                .bind::<Nullable<BigInt>, _>(after_ms)
                .bind::<Nullable<Timestamptz>, _>(at)
                .get_result(conn)
                .await?;
                if let Some(outcome) = row.outcome {
                    return Ok(WaitStep::Done(outcome));
                }
                let outcome = match ask.kind {
                    WaitKind::Sleep => row.due.then(|| json!({ "slept": true })),
                    WaitKind::Signal | WaitKind::Approval => {
                        let taken: Vec<Taken> = sql(
                            "UPDATE signals SET taken_by = $2 \
                             WHERE (job_id, name, signal_id) = ( \
                                 SELECT job_id, name, signal_id FROM signals \
                                 WHERE job_id = $1 AND name = $3 AND taken_by IS NULL \
                                 ORDER BY seq LIMIT 1 FOR UPDATE) \
                             RETURNING signal_id, payload",
                        )
                        .bind::<Text, _>(&fence.job_id)
                        .bind::<Text, _>(ask.key)
                        .bind::<Text, _>(ask.name)
                        .load(conn)
                        .await?;
                        match taken.into_iter().next() {
                            Some(t) => Some(json!({ "signal": { "id": t.signal_id, "payload": t.payload } })),
                            None => row.due.then(|| json!({ "timeout": true })),
                        }
                    }
                };
                match outcome {
                    Some(outcome) => {
                        sql(
                            "WITH done AS (UPDATE waits SET outcome = $3, done_at = now() \
                                 WHERE job_id = $1 AND wait_key = $2) \
                             UPDATE jobs SET waiting = NULL WHERE id = $1 AND waiting IS NOT NULL",
                        )
                        .bind::<Text, _>(&fence.job_id)
                        .bind::<Text, _>(ask.key)
                        .bind::<Jsonb, _>(&outcome)
                        .execute(conn)
                        .await?;
                        Ok(WaitStep::Done(outcome))
                    }
                    None => {
                        let mut waiting = json!({
                            "kind": ask.kind.as_str(),
                            "name": ask.name,
                            "until": row.until,
                        });
                        if let Some(Value::Object(detail)) = ask.detail {
                            for (k, v) in detail {
                                waiting[k] = v.clone();
                            }
                        }
                        if let Some((key, event)) = ask.event {
                            // Once per wait: the key is the event's identity,
                            // and the event's name (one row per job and
                            // event) is the wait's (`keys::waiting`).
                            // Announced on EVENTS_CHANNEL: any node sends it.
                            sql(
                                "WITH ev AS (INSERT INTO outbox (job_id, event, idempotency_key, url, body) \
                                 SELECT id, $3, $2, request->>'webhook_url', \
                                     jsonb_build_object('type', 'job.waiting', 'timestamp', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), 'data', jsonb_build_object('job_id', id, 'waiting', $4::jsonb)) \
                                 FROM jobs WHERE id = $1 AND request->>'webhook_url' <> '' \
                                 ON CONFLICT DO NOTHING RETURNING job_id) \
                                 SELECT pg_notify($5, job_id) FROM ev",
                            )
                            .bind::<Text, _>(&fence.job_id)
                            .bind::<Text, _>(key)
                            .bind::<Text, _>(event)
                            .bind::<Jsonb, _>(&waiting)
                            .bind::<Text, _>(super::events::EVENTS_CHANNEL)
                            .execute(conn)
                            .await?;
                        }
                        sql(
                            "UPDATE jobs SET waiting = $3, run_at = $4, lease_owner = NULL, \
                                 lease_expires_at = NULL, updated_at = now() \
                             WHERE id = $1 AND lease_epoch = $2",
                        )
                        .bind::<Text, _>(&fence.job_id)
                        .bind::<BigInt, _>(fence.epoch)
                        .bind::<Jsonb, _>(&waiting)
                        .bind::<Timestamptz, _>(row.until)
                        .execute(conn)
                        .await?;
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

    /// Records signal `signal_id` of `name` for job `job_id` (once: the
    /// same id again is the same signal), and makes a job waiting for that
    /// name due at once, waking the nodes. The job's row is locked first,
    /// as a wait locks it, so a signal and a wait that reach the job at the
    /// same moment are ordered: either the wait takes the signal, or the
    /// signal finds the job waiting and wakes it.
    pub async fn signal(
        &self,
        job_id: &str,
        name: &str,
        signal_id: &str,
        payload: &Value,
    ) -> Result<SignalOutcome, StoreError> {
        self.signal_for_wait(job_id, name, signal_id, payload, None)
            .await
    }

    /// [`signal`](Self::signal), for the wait due at `until` when given: a
    /// new signal is recorded only while the job waits for the signal (or
    /// approval) `name` with that due time, so a decision on a wait that is over (decided, timed out)
    /// is never kept for a later wait of the same name.
    pub async fn signal_for_wait(
        &self,
        job_id: &str,
        name: &str,
        signal_id: &str,
        payload: &Value,
        until: Option<DateTime<Utc>>,
    ) -> Result<SignalOutcome, StoreError> {
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
                if let Some(until) = until {
                    #[derive(QueryableByName)]
                    struct Waits {
                        #[diesel(sql_type = Bool)]
                        waits: bool,
                    }
                    let now: Waits = sql(
                        "SELECT coalesce(waiting->>'kind' IN ('signal', 'approval') \
                             AND waiting->>'name' = $2 \
                             AND (waiting->>'until')::timestamptz = $3, false) AS waits \
                         FROM jobs WHERE id = $1",
                    )
                    .bind::<Text, _>(job_id)
                    .bind::<Text, _>(name)
                    .bind::<Timestamptz, _>(until)
                    .get_result(conn)
                    .await?;
                    if !now.waits {
                        return Ok(SignalOutcome::NotWaiting);
                    }
                }
                let view: SignalView = sql(
                    "INSERT INTO signals (job_id, name, signal_id, payload, payload_hash) \
                     VALUES ($1, $2, $3, $4, $5) \
                     RETURNING name, signal_id AS id, payload, received_at, taken_by",
                )
                .bind::<Text, _>(job_id)
                .bind::<Text, _>(name)
                .bind::<Text, _>(signal_id)
                .bind::<Jsonb, _>(payload)
                .bind::<Text, _>(hash)
                .get_result(conn)
                .await?;
                // A job waiting for this name (and released) is due now.
                sql(
                    "WITH woken AS (UPDATE jobs SET run_at = now(), updated_at = now() \
                         WHERE id = $1 AND finished_at IS NULL AND lease_owner IS NULL \
                           AND waiting->>'kind' IN ('signal', 'approval') AND waiting->>'name' = $2 \
                         RETURNING id) \
                     SELECT pg_notify($3, id) FROM woken",
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

    /// The signals of job `job_id`, oldest first.
    pub async fn signals_of(&self, job_id: &str) -> Result<Vec<SignalView>, StoreError> {
        let mut conn = self.db().conn().await?;
        Ok(sql(
            "SELECT name, signal_id AS id, payload, received_at, taken_by FROM signals \
             WHERE job_id = $1 ORDER BY seq",
        )
        .bind::<Text, _>(job_id)
        .load(&mut conn)
        .await?)
    }
}
