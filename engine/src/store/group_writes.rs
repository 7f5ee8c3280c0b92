//! The checkpoints written through [`Batcher`]s: `delivered → acked` (one
//! commit: the two follow each other), `acked` alone (a job found at
//! `delivered`), and
//! the journaling of a model call's answer. Each is one statement over
//! arrays for a whole batch, with the same guard as the single-job form
//! (state and lease epoch per row), the job rows locked in id order first.
//!
//! Every bound array is read through a sub-select, `(SELECT $1::text[])`.
//! A prepared statement's first five runs are planned for their values; a
//! bound array is then a constant whose length sizes `unnest` and `= ANY`,
//! so a batch of three always looked cheaper than the cached generic plan
//! (sized for ten) and PostgreSQL planned the statement afresh at every call
//! (0.1–0.2 ms beside 0.2–0.8 ms of execution, measured with
//! `pg_stat_statements.track_planning`). Behind a sub-select both plans see
//! the same estimate, and from the sixth run the generic plan is used.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use super::group_commit::{Batcher, ForJob, Keyed};
use super::rows::{lock_in_order, IdRow, INTAKE_WORKER, NEW_JOB_CHANNEL};
use super::sql::sql;
use super::streams::stream_on;
use super::{Checkpoint, Fence, GroupCommit, Store};
use crate::db::Db;
use crate::error::{BatchError, StoreError};

/// `delivered → acked` for one job.
#[derive(Clone)]
pub(crate) struct Ack {
    pub(crate) fence: Fence,
}

/// `claimed → delivered → acked` for one job, with its outbox row.
#[derive(Clone)]
pub(crate) struct Delivered {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) status: i32,
}

/// A model call's answer, journaled under its key (fenced; no state change).
#[derive(Clone)]
pub(crate) struct ModelAnswer {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) response: Value,
    pub(crate) usage: (Option<i32>, Option<i32>),
}

/// `received`/`generated`/`persisted` → `claimed` for one job: its result,
/// its outbox row and a history row per state passed.
#[derive(Clone)]
pub(crate) struct CommitResult {
    pub(crate) fence: Fence,
    pub(crate) from: &'static str,
    /// The states passed, in order, comma-separated (`generated,persisted,claimed`).
    pub(crate) passed: String,
    pub(crate) output: Value,
    pub(crate) event: String,
    pub(crate) key: String,
    pub(crate) url: String,
    pub(crate) body: Value,
    pub(crate) in_flight_ms: Option<i64>,
    /// The lease runs at least this long from the commit (see
    /// [`Claim::lease_ms`](super::journal::Claim::lease_ms)).
    pub(crate) lease_ms: Option<i64>,
}

/// The fast path of `begin_model_call`: the fenced insert of a fresh row,
/// born in flight, or the existing row as stored.
#[derive(Clone)]
pub(crate) struct BeginCall {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) request_hash: String,
    pub(crate) in_flight_ms: i64,
}

/// The row `BeginCall` found or created.
#[derive(Clone, QueryableByName)]
pub(crate) struct CallRow {
    #[diesel(sql_type = Text)]
    pub(crate) key: String,
    /// The job the row belongs to: a key is one job's only.
    #[diesel(sql_type = Text)]
    pub(crate) job_id: String,
    #[diesel(sql_type = Text)]
    pub(crate) request_hash: String,
    #[diesel(sql_type = Text)]
    pub(crate) status: String,
    #[diesel(sql_type = Nullable<Jsonb>)]
    pub(crate) response: Option<Value>,
    #[diesel(sql_type = Integer)]
    pub(crate) attempts: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub(crate) in_flight_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) in_flight_epoch: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    pub(crate) now: DateTime<Utc>,
    /// Created by this statement (`xmax = 0`).
    #[diesel(sql_type = Bool)]
    pub(crate) inserted: bool,
}

impl ForJob for CommitResult {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}
impl ForJob for BeginCall {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// A new job for intake: its row, first history row and wake-up.
#[derive(Clone)]
pub(crate) struct NewRow {
    pub(crate) id: String,
    pub(crate) workflow: String,
    pub(crate) workflow_version: i32,
    pub(crate) request: Value,
    pub(crate) request_hash: String,
    pub(crate) trace: String,
    pub(crate) owner: Option<i64>,
    pub(crate) notify_failures: bool,
    pub(crate) priority: i32,
    pub(crate) run_at: Option<DateTime<Utc>>,
    pub(crate) delay_ms: Option<i64>,
    /// Insert it leased to this node for this many milliseconds (a
    /// hand-off, see [`crate::node::handoff`]).
    pub(crate) lease: Option<(String, i64)>,
    /// The job whose workflow started it (`ctx.spawn`).
    pub(crate) parent: Option<String>,
    /// The workflow's limit per concurrency key, if it sets one (the key
    /// itself is in `request`).
    pub(crate) key_limit: Option<i32>,
    /// The workflow's throttle per concurrency key, if it sets one: starts
    /// per period, and the period in seconds.
    pub(crate) throttle: Option<(i32, i32)>,
    /// The most unfinished jobs its owner may have in the cluster: a row
    /// over it is left out (see [`intake_on`]).
    pub(crate) backlog_limit: Option<i64>,
}

impl Keyed for NewRow {
    fn job_id(&self) -> &str {
        &self.id
    }
}

/// A job intake created.
#[derive(Clone, QueryableByName)]
pub(crate) struct Inserted {
    #[diesel(sql_type = Text)]
    pub(crate) id: String,
    #[diesel(sql_type = Timestamptz)]
    pub(crate) created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    pub(crate) at: DateTime<Utc>,
    #[diesel(sql_type = Integer)]
    pub(crate) incarnation: i32,
    #[diesel(sql_type = Timestamptz)]
    pub(crate) run_at: DateTime<Utc>,
    #[diesel(sql_type = BigInt)]
    pub(crate) lease_epoch: i64,
    #[diesel(sql_type = Integer)]
    pub(crate) attempts: i32,
    #[diesel(sql_type = Bool)]
    pub(crate) leased: bool,
}

impl ForJob for Ack {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}
impl ForJob for Delivered {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}
impl ForJob for ModelAnswer {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// One key of a job's journal and, for a wait that is over, its outcome.
pub(crate) type JournalKey = (String, Option<Value>);

/// A rerun's read of its job's journal, batched with other jobs' reads
/// (see [`journal_on`]).
#[derive(Clone)]
pub(crate) struct JournalRead {
    pub(crate) fence: Fence,
}

impl ForJob for JournalRead {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// Each job's journal (model calls, tool calls, steps, waits) in the order
/// its keys were first journaled, for many jobs in one statement; one list
/// per request, in order. A read, so it locks nothing: it runs after the
/// acquire that moved the epoch has committed, and no earlier attempt can
/// journal anything after that.
pub(crate) async fn journal_on(
    conn: &mut AsyncPgConnection,
    requests: &[JournalRead],
) -> Result<Vec<Vec<JournalKey>>, StoreError> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        job_id: String,
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Nullable<Jsonb>)]
        outcome: Option<Value>,
    }
    let ids: Vec<&str> = requests.iter().map(|r| r.fence.job_id.as_str()).collect();
    let prefixes: Vec<String> = requests
        .iter()
        .map(|r| r.fence.key().as_str().to_owned())
        .collect();
    let rows: Vec<Row> = sql(
        "WITH input AS (SELECT * FROM unnest((SELECT $1::text[]), (SELECT $2::text[])) \
             AS i(id, prefix)) \
         SELECT job_id, key, outcome FROM ( \
             SELECT m.job_id, m.idempotency_key AS key, m.created_at, m.id AS seq, \
                     NULL::jsonb AS outcome \
                 FROM model_calls m JOIN input i ON m.job_id = i.id \
             UNION ALL SELECT t.job_id, i.prefix || ':tool:' || t.turn || ':' || t.call_index, \
                     t.created_at, t.id, NULL \
                 FROM tool_calls t JOIN input i ON t.job_id = i.id \
             UNION ALL SELECT s.job_id, s.step_key, s.created_at, 0, NULL \
                 FROM steps s JOIN input i ON s.job_id = i.id \
             UNION ALL SELECT w.job_id, w.wait_key, w.created_at, 0, w.outcome \
                 FROM waits w JOIN input i ON w.job_id = i.id) k \
         ORDER BY job_id, created_at, seq",
    )
    .bind::<diesel::sql_types::Array<Text>, _>(&ids)
    .bind::<diesel::sql_types::Array<Text>, _>(&prefixes)
    .load(conn)
    .await?;
    let mut by_job: std::collections::HashMap<String, Vec<JournalKey>> =
        std::collections::HashMap::with_capacity(requests.len());
    for r in rows {
        by_job.entry(r.job_id).or_default().push((r.key, r.outcome));
    }
    Ok(requests
        .iter()
        .map(|r| by_job.remove(&r.fence.job_id).unwrap_or_default())
        .collect())
}

/// The batchers of one store.
#[derive(Debug)]
pub(crate) struct Batches {
    pub(crate) ack: Batcher<Ack, Checkpoint>,
    pub(crate) delivered: Batcher<Delivered, Checkpoint>,
    pub(crate) model_answer: Batcher<ModelAnswer, Checkpoint>,
    /// New jobs: `None` for an id that exists already.
    pub(crate) intake: Batcher<NewRow, Option<Inserted>>,
    pub(crate) commit_result: Batcher<CommitResult, Checkpoint>,
    /// `None`: the lease is lost.
    pub(crate) begin_call: Batcher<BeginCall, Option<CallRow>>,
    /// Chunks of streamed answers.
    pub(crate) stream: Batcher<super::streams::StreamWrite, super::streams::Written>,
    /// Reruns' reads of their journals (a read, batched the same way).
    pub(crate) journal: Batcher<JournalRead, Vec<JournalKey>>,
}

/// A batch statement `f(conn, requests)` run on a connection of the pool.
macro_rules! pooled {
    ($f:ident) => {
        Box::new(|pool: Pool<AsyncPgConnection>, requests| {
            Box::pin(async move {
                let mut conn = pool.get().await?;
                $f(&mut conn, &requests).await
            })
        })
    };
}

impl Batches {
    pub(crate) fn start(db: &Db) -> Arc<Batches> {
        Arc::new(Batches {
            ack: Batcher::start(db, pooled!(ack_on)),
            delivered: Batcher::start(db, pooled!(delivered_on)),
            model_answer: Batcher::start(db, pooled!(model_answer_on)),
            intake: Batcher::start(db, pooled!(intake_on)),
            commit_result: Batcher::start(db, pooled!(commit_result_on)),
            begin_call: Batcher::start(db, pooled!(begin_call_on)),
            stream: Batcher::start(db, pooled!(stream_on)),
            journal: Batcher::start_read(db, pooled!(journal_on)),
        })
    }
}

/// Moved for the rows the statement returned; for the others, why not (rare).
async fn outcomes<R: ForJob>(
    conn: &mut AsyncPgConnection,
    requests: &[R],
    moved: Vec<IdRow>,
) -> Result<Vec<Checkpoint>, StoreError> {
    let moved: HashSet<String> = moved.into_iter().map(|r| r.id).collect();
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        out.push(if moved.contains(r.job_id()) {
            Checkpoint::Moved
        } else {
            Store::why_not(conn, r.fence()).await?
        });
    }
    Ok(out)
}

fn fences<R: ForJob>(requests: &[R]) -> (Vec<String>, Vec<i64>, Vec<i32>, Vec<String>) {
    let mut ids = Vec::with_capacity(requests.len());
    let mut epochs = Vec::with_capacity(requests.len());
    let mut attempts = Vec::with_capacity(requests.len());
    let mut workers = Vec::with_capacity(requests.len());
    for r in requests {
        let f = r.fence();
        ids.push(f.job_id.clone());
        epochs.push(f.epoch);
        attempts.push(f.attempt);
        workers.push(f.worker.clone());
    }
    (ids, epochs, attempts, workers)
}

pub(crate) async fn ack_on(
    conn: &mut AsyncPgConnection,
    requests: &[Ack],
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, attempts, workers) = fences(requests);
    let moved: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::int[]), \
                 (SELECT $4::text[])) \
             AS i(id, epoch, attempt, worker)), \
",
        lock_in_order!("$1"),
        ", ",
        "         moved AS ( \
             UPDATE jobs j SET state = 'acked', updated_at = now(), finished_at = now(), \
                 lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL \
             FROM input i \
             WHERE j.id = i.id AND j.state = 'delivered' AND j.lease_epoch = i.epoch \
               AND (SELECT count(*) FROM locked) >= 0 \
             RETURNING j.id, i.attempt, i.worker), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT id, 'acked', attempt, worker FROM moved) \
         SELECT id FROM moved"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Text>, _>(&workers)
    .load(conn)
    .await?;
    outcomes(conn, requests, moved).await
}

pub(crate) async fn delivered_on(
    conn: &mut AsyncPgConnection,
    requests: &[Delivered],
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, attempts, workers) = fences(requests);
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let statuses: Vec<i32> = requests.iter().map(|r| r.status).collect();
    let moved: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::int[]), \
                 (SELECT $4::text[]), (SELECT $5::text[]), (SELECT $6::int[])) \
             AS i(id, epoch, attempt, worker, key, status)), \
",
        lock_in_order!("$1"),
        ", ",
        "         moved AS ( \
             UPDATE jobs j SET state = 'acked', updated_at = now(), finished_at = now(), \
                 lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL \
             FROM input i \
             WHERE j.id = i.id AND j.state = 'claimed' AND j.lease_epoch = i.epoch \
               AND (SELECT count(*) FROM locked) >= 0 \
             RETURNING j.id, i.attempt, i.worker, i.key, i.status), \
         sent AS ( \
             UPDATE outbox o SET status = 'delivered', delivered_at = now(), last_status = m.status, \
                 in_flight_until = NULL, updated_at = now() \
             FROM moved m WHERE o.idempotency_key = m.key AND o.status = 'claimed'), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT m.id, s.state, m.attempt, m.worker \
             FROM moved m, unnest('{delivered,acked}'::job_state[]) WITH ORDINALITY AS s(state, n) \
             ORDER BY m.id, s.n) \
         SELECT id FROM moved"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Text>, _>(&workers)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Integer>, _>(&statuses)
    .load(conn)
    .await?;
    outcomes(conn, requests, moved).await
}

/// Moves each job from its state to `claimed` with the guard on that state
/// and the epoch, writing its result (first writer wins), its outbox row
/// (under its UNIQUE key) and one history row per state passed, in order.
pub(crate) async fn commit_result_on(
    conn: &mut AsyncPgConnection,
    requests: &[CommitResult],
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, attempts, workers) = fences(requests);
    let from: Vec<&str> = requests.iter().map(|r| r.from).collect();
    let passed: Vec<&str> = requests.iter().map(|r| r.passed.as_str()).collect();
    let outputs: Vec<&Value> = requests.iter().map(|r| &r.output).collect();
    let events: Vec<&str> = requests.iter().map(|r| r.event.as_str()).collect();
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let urls: Vec<&str> = requests.iter().map(|r| r.url.as_str()).collect();
    let bodies: Vec<&Value> = requests.iter().map(|r| &r.body).collect();
    let in_flight: Vec<Option<i64>> = requests.iter().map(|r| r.in_flight_ms).collect();
    let lease: Vec<Option<i64>> = requests.iter().map(|r| r.lease_ms).collect();
    let moved: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::int[]), \
                 (SELECT $4::text[]), (SELECT $5::text[]), (SELECT $6::text[]), \
                 (SELECT $7::jsonb[]), (SELECT $8::text[]), (SELECT $9::text[]), \
                 (SELECT $10::text[]), (SELECT $11::jsonb[]), (SELECT $12::bigint[]), \
                 (SELECT $13::bigint[])) \
             AS i(id, epoch, attempt, worker, from_state, passed, output, event, key, url, body, \
                  in_flight_ms, lease_ms)), \
",
        lock_in_order!("$1"),
        ", ",
        "         moved AS ( \
             UPDATE jobs j SET state = 'claimed', updated_at = now(), \
                 lease_expires_at = CASE WHEN i.lease_ms IS NULL OR j.lease_owner IS NULL \
                     THEN j.lease_expires_at \
                     ELSE greatest(j.lease_expires_at, clock_timestamp() + i.lease_ms * interval '1 millisecond') END \
             FROM input i \
             WHERE j.id = i.id AND j.state = i.from_state::job_state AND j.lease_epoch = i.epoch \
               AND (SELECT count(*) FROM locked) >= 0 \
             RETURNING j.id, i.epoch, i.attempt, i.worker, i.passed, i.output, i.event, i.key, i.url, \
                 i.body, i.in_flight_ms), \
         result AS ( \
             INSERT INTO results (job_id, output) SELECT id, output FROM moved \
             ON CONFLICT (job_id) DO NOTHING), \
         claim AS ( \
             INSERT INTO outbox (job_id, event, idempotency_key, url, body, attempts, \
                 in_flight_until, in_flight_epoch) \
             SELECT id, event, key, url, body, CASE WHEN in_flight_ms IS NULL THEN 0 ELSE 1 END, \
                 clock_timestamp() + in_flight_ms * interval '1 millisecond', \
                 CASE WHEN in_flight_ms IS NULL THEN NULL ELSE epoch END \
             FROM moved ORDER BY key \
             ON CONFLICT (idempotency_key) DO NOTHING), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT m.id, s.state::job_state, m.attempt, m.worker \
             FROM moved m, unnest(string_to_array(m.passed, ',')) WITH ORDINALITY AS s(state, n) \
             ORDER BY m.id, s.n) \
         SELECT id FROM moved"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Text>, _>(&workers)
    .bind::<Array<Text>, _>(&from)
    .bind::<Array<Text>, _>(&passed)
    .bind::<Array<Jsonb>, _>(&outputs)
    .bind::<Array<Text>, _>(&events)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Text>, _>(&urls)
    .bind::<Array<Jsonb>, _>(&bodies)
    .bind::<Array<Nullable<BigInt>>, _>(&in_flight)
    .bind::<Array<Nullable<BigInt>>, _>(&lease)
    .load(conn)
    .await?;
    outcomes(conn, requests, moved).await
}

/// For each model call, the fenced insert of a fresh row born in flight for
/// its attempt, or the existing row as stored; none for a job whose lease
/// is gone. Jobs are locked in id order first, as every batch does.
pub(crate) async fn begin_call_on(
    conn: &mut AsyncPgConnection,
    requests: &[BeginCall],
) -> Result<Vec<Option<CallRow>>, StoreError> {
    let (ids, epochs, _, _) = fences(requests);
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let hashes: Vec<&str> = requests.iter().map(|r| r.request_hash.as_str()).collect();
    let in_flight: Vec<i64> = requests.iter().map(|r| r.in_flight_ms).collect();
    let rows: Vec<CallRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[]), \
                 (SELECT $4::text[]), (SELECT $5::bigint[])) \
             AS i(id, epoch, key, request_hash, in_flight_ms)), \
",
        lock_in_order!("$1"),
        " INSERT INTO model_calls (job_id, idempotency_key, request_hash, attempts, \
             in_flight_until, in_flight_epoch) \
         SELECT i.id, i.key, i.request_hash, 1, \
             clock_timestamp() + i.in_flight_ms * interval '1 millisecond', i.epoch \
         FROM input i JOIN locked l ON l.id = i.id AND l.lease_epoch = i.epoch \
         WHERE (SELECT count(*) FROM locked) >= 0 \
         ORDER BY i.key \
         ON CONFLICT (idempotency_key) DO UPDATE SET updated_at = model_calls.updated_at \
         RETURNING idempotency_key AS key, job_id, request_hash, status::text AS status, response, attempts, \
             in_flight_until, in_flight_epoch, clock_timestamp() AS now, (xmax = 0) AS inserted"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Text>, _>(&hashes)
    .bind::<Array<BigInt>, _>(&in_flight)
    .load(conn)
    .await?;
    let mut by_key: std::collections::HashMap<String, CallRow> =
        rows.into_iter().map(|r| (r.key.clone(), r)).collect();
    Ok(requests.iter().map(|r| by_key.remove(&r.key)).collect())
}

/// Inserts new jobs, each with its first history row, in one statement and
/// one commit, and wakes the nodes with one `NOTIFY` for the batch. Rows
/// are inserted in id order, so two batches that race on an id wait in the
/// same order. An id that exists already inserts nothing (the primary key
/// decides); its request gets `None`.
///
/// A row with a `backlog_limit` is also left out (`None`) when its owner
/// already has that many unfinished jobs, in the whole cluster: the owners'
/// locks (`pg_advisory_xact_lock`, in owner order) are taken first, in the
/// same transaction, so the insert's snapshot sees every job another
/// node's intake committed for them, and the next intake of theirs waits
/// for this one's commit. A row whose id exists already takes no place.
pub(crate) async fn intake_on(
    conn: &mut AsyncPgConnection,
    requests: &[NewRow],
) -> Result<Vec<Option<Inserted>>, StoreError> {
    let mut owners: Vec<i64> = requests
        .iter()
        .filter(|r| r.backlog_limit.is_some())
        .filter_map(|r| r.owner)
        .collect();
    if owners.is_empty() {
        return insert_jobs(conn, requests).await;
    }
    owners.sort_unstable();
    owners.dedup();
    use diesel_async::AsyncConnection as _;
    conn.transaction::<_, StoreError, _>(async move |conn| {
        // One at a time, in owner order: two intakes never wait on each
        // other in a circle. (A hash collision only serialises more.)
        for owner in &owners {
            sql("SELECT pg_advisory_xact_lock($1, hashint8($2))")
                .bind::<Integer, _>(BACKLOG_LOCK_CLASS)
                .bind::<BigInt, _>(owner)
                .execute(conn)
                .await?;
        }
        insert_jobs(conn, requests).await
    })
    .await
}

/// The first key of the advisory locks that serialise intake per owner
/// (`pg_advisory_xact_lock(class, owner)`), its second the token id.
const BACKLOG_LOCK_CLASS: i32 = 0x6f66_626c; // "ofbl"

async fn insert_jobs(
    conn: &mut AsyncPgConnection,
    requests: &[NewRow],
) -> Result<Vec<Option<Inserted>>, StoreError> {
    let n = requests.len();
    let mut ids = Vec::with_capacity(n);
    let mut workflows = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut bodies = Vec::with_capacity(n);
    let mut hashes = Vec::with_capacity(n);
    let mut traces = Vec::with_capacity(n);
    let mut owners = Vec::with_capacity(n);
    let mut notify = Vec::with_capacity(n);
    let mut priorities = Vec::with_capacity(n);
    let mut run_ats = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    let mut lease_owners = Vec::with_capacity(n);
    let mut lease_ms = Vec::with_capacity(n);
    let mut parents = Vec::with_capacity(n);
    let mut key_limits = Vec::with_capacity(n);
    let mut throttle_starts = Vec::with_capacity(n);
    let mut throttle_periods = Vec::with_capacity(n);
    let mut backlog_limits = Vec::with_capacity(n);
    for r in requests {
        backlog_limits.push(r.backlog_limit);
        key_limits.push(r.key_limit);
        throttle_starts.push(r.throttle.map(|t| t.0));
        throttle_periods.push(r.throttle.map(|t| t.1));
        parents.push(r.parent.as_deref());
        lease_owners.push(r.lease.as_ref().map(|(node, _)| node.as_str()));
        lease_ms.push(r.lease.as_ref().map(|(_, ms)| *ms));
        priorities.push(r.priority);
        run_ats.push(r.run_at);
        delays.push(r.delay_ms);
        ids.push(r.id.as_str());
        workflows.push(r.workflow.as_str());
        versions.push(r.workflow_version);
        bodies.push(&r.request);
        hashes.push(r.request_hash.as_str());
        traces.push(r.trace.as_str());
        owners.push(r.owner);
        notify.push(r.notify_failures);
    }
    // A handed-off row is born leased, exactly as an acquire would lease
    // it (owner, epoch + 1, expiry, attempt 1); only unleased rows wake the
    // nodes.
    let inserted: Vec<Inserted> = sql(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::text[]), (SELECT $3::int[]), \
                 (SELECT $4::jsonb[]), (SELECT $5::text[]), (SELECT $6::text[]), \
                 (SELECT $7::bigint[]), (SELECT $8::bool[]), (SELECT $11::int[]), \
                 (SELECT $12::timestamptz[]), (SELECT $13::bigint[]), (SELECT $14::text[]), \
                 (SELECT $15::bigint[]), (SELECT $16::text[]), (SELECT $17::int[]), \
                 (SELECT $18::int[]), (SELECT $19::int[]), (SELECT $20::bigint[])) \
                 WITH ORDINALITY \
             AS i(id, workflow, workflow_version, request, request_hash, trace_context, owner_token, \
                  notify_failures, priority, run_at, delay_ms, lease_owner, lease_ms, parent_id, key_limit, \
                  t_starts, t_period, backlog_limit, n)), \
         owners AS ( \
             SELECT i.owner_token, max(i.backlog_limit) AS lim, \
                 CASE WHEN k.admin IS false THEN k.id ELSE 0 END AS tenant \
             FROM input i LEFT JOIN api_tokens k ON k.id = i.owner_token \
             WHERE i.backlog_limit IS NOT NULL AND i.owner_token IS NOT NULL \
             GROUP BY i.owner_token, k.admin, k.id), \
         live AS ( \
             SELECT o.owner_token, o.lim - (SELECT count(*) FROM (SELECT 1 FROM jobs j \
                 WHERE j.tenant = o.tenant AND j.owner_token = o.owner_token \
                   AND j.finished_at IS NULL LIMIT o.lim) q) AS room \
             FROM owners o), \
         fresh AS ( \
             SELECT i.id, i.owner_token, \
                 row_number() OVER (PARTITION BY i.owner_token ORDER BY i.n) AS place \
             FROM input i \
             WHERE i.backlog_limit IS NOT NULL AND i.owner_token IS NOT NULL \
               AND NOT EXISTS (SELECT 1 FROM jobs x WHERE x.id = i.id)), \
         over AS ( \
             SELECT f.id FROM fresh f JOIN live l ON l.owner_token = f.owner_token \
             WHERE f.place > l.room), \
         job AS ( \
             INSERT INTO jobs (id, workflow, workflow_version, request, request_hash, trace_context, \
                 incarnation, lease_epoch, owner_token, notify_failures, priority, run_at, \
                 lease_owner, lease_expires_at, attempts, parent_id, parent_incarnation, \
                 tenant, concurrency_key, concurrency_limit, throttle_limit, throttle_period_s) \
             SELECT i.id, i.workflow, i.workflow_version, i.request, i.request_hash, i.trace_context, \
                 coalesce(t.incarnation + 1, 1), \
                 coalesce(t.last_epoch, 0) + (i.lease_owner IS NOT NULL)::int, \
                 i.owner_token, i.notify_failures, \
                 i.priority, CASE WHEN i.run_at IS NOT NULL THEN greatest(i.run_at, now()) \
                     ELSE now() + coalesce(i.delay_ms, 0) * interval '1 millisecond' END, \
                 i.lease_owner, clock_timestamp() + i.lease_ms * interval '1 millisecond', \
                 (i.lease_owner IS NOT NULL)::int, i.parent_id, p.incarnation, \
                 CASE WHEN k.admin IS false THEN k.id ELSE 0 END, \
                 i.request->>'concurrency_key', \
                 CASE WHEN i.request ? 'concurrency_key' THEN \
                     least(coalesce(k.key_concurrency, i.key_limit, 1), \
                           coalesce(i.key_limit, k.key_concurrency, 1)) END, \
                 CASE WHEN i.request ? 'concurrency_key' THEN \
                     coalesce(least(i.t_starts, k.key_throttle), i.t_starts, k.key_throttle) END, \
                 CASE WHEN i.request ? 'concurrency_key' THEN \
                     coalesce(greatest(i.t_period, k.key_throttle_period_s), \
                              i.t_period, k.key_throttle_period_s) END \
             FROM input i LEFT JOIN job_tombstones t ON t.id = i.id \
                 LEFT JOIN api_tokens k ON k.id = i.owner_token \
                 LEFT JOIN jobs p ON p.id = i.parent_id \
             WHERE i.id NOT IN (SELECT id FROM over) \
             ORDER BY i.id \
             ON CONFLICT (id) DO NOTHING \
             RETURNING id, created_at, incarnation, run_at, lease_epoch, attempts, \
                 lease_owner IS NOT NULL AS leased), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT id, 'received', 0, $9 FROM job RETURNING job_id, at) \
         SELECT job.id, job.created_at, history.at, job.incarnation, job.run_at, \
             job.lease_epoch, job.attempts, job.leased, \
             (SELECT pg_notify($10, count(*)::text) FROM job WHERE NOT job.leased \
                 HAVING count(*) > 0) IS NULL AS notified \
         FROM job JOIN history ON history.job_id = job.id",
    )
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<Text>, _>(&workflows)
    .bind::<Array<Integer>, _>(&versions)
    .bind::<Array<Jsonb>, _>(&bodies)
    .bind::<Array<Text>, _>(&hashes)
    .bind::<Array<Text>, _>(&traces)
    .bind::<Array<Nullable<BigInt>>, _>(&owners)
    .bind::<Array<Bool>, _>(&notify)
    .bind::<Text, _>(INTAKE_WORKER)
    .bind::<Text, _>(NEW_JOB_CHANNEL)
    .bind::<Array<Integer>, _>(&priorities)
    .bind::<Array<Nullable<Timestamptz>>, _>(&run_ats)
    .bind::<Array<Nullable<BigInt>>, _>(&delays)
    .bind::<Array<Nullable<Text>>, _>(&lease_owners)
    .bind::<Array<Nullable<BigInt>>, _>(&lease_ms)
    .bind::<Array<Nullable<Text>>, _>(&parents)
    .bind::<Array<Nullable<Integer>>, _>(&key_limits)
    .bind::<Array<Nullable<Integer>>, _>(&throttle_starts)
    .bind::<Array<Nullable<Integer>>, _>(&throttle_periods)
    .bind::<Array<Nullable<BigInt>>, _>(&backlog_limits)
    .load(conn)
    .await?;
    let mut by_id: std::collections::HashMap<String, Inserted> =
        inserted.into_iter().map(|r| (r.id.clone(), r)).collect();
    Ok(requests.iter().map(|r| by_id.remove(&r.id)).collect())
}

pub(crate) async fn model_answer_on(
    conn: &mut AsyncPgConnection,
    requests: &[ModelAnswer],
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, _, _) = fences(requests);
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let responses: Vec<&Value> = requests.iter().map(|r| &r.response).collect();
    let input_tokens: Vec<Option<i32>> = requests.iter().map(|r| r.usage.0).collect();
    let output_tokens: Vec<Option<i32>> = requests.iter().map(|r| r.usage.1).collect();
    let written: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest( \
                 (SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[]), \
                 (SELECT $4::jsonb[]), (SELECT $5::int[]), (SELECT $6::int[])) \
             AS i(id, epoch, key, response, input_tokens, output_tokens)), \
",
        lock_in_order!("$1"),
        ", ",
        "         fenced AS ( \
             SELECT i.* FROM input i JOIN locked l ON l.id = i.id AND l.lease_epoch = i.epoch \
             WHERE (SELECT count(*) FROM locked) >= 0), \
         written AS ( \
             UPDATE model_calls m SET status = 'completed', response = f.response, \
                 input_tokens = f.input_tokens, output_tokens = f.output_tokens, \
                 in_flight_until = NULL, last_error = NULL, updated_at = now() \
             FROM fenced f WHERE m.idempotency_key = f.key AND m.job_id = f.id \
               AND m.status <> 'completed' \
             RETURNING m.job_id, m.idempotency_key, m.input_tokens, m.output_tokens), \
         settled AS ( \
             DELETE FROM budget_holds h USING written w WHERE h.call_key = w.idempotency_key), \
         spent AS ( \
             INSERT INTO token_spend (tenant, day, tokens) \
             SELECT j.tenant, (now() AT TIME ZONE 'UTC')::date, \
                 sum(coalesce(w.input_tokens, 0) + coalesce(w.output_tokens, 0)) \
             FROM written w JOIN jobs j ON j.id = w.job_id \
                 JOIN api_tokens t ON t.id = j.tenant AND t.daily_token_budget IS NOT NULL \
             GROUP BY j.tenant ORDER BY j.tenant \
             ON CONFLICT (tenant, day) DO UPDATE SET tokens = token_spend.tokens + excluded.tokens) \
         SELECT id FROM fenced"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Jsonb>, _>(&responses)
    .bind::<Array<Nullable<Integer>>, _>(&input_tokens)
    .bind::<Array<Nullable<Integer>>, _>(&output_tokens)
    .load(conn)
    .await?;
    // No state moves here: a job not fenced means the lease is gone. A row
    // already completed (by a sibling attempt under the same lease, or by
    // this request's own earlier try whose answer was lost) is kept as it is.
    let written: HashSet<String> = written.into_iter().map(|r| r.id).collect();
    Ok(requests
        .iter()
        .map(|r| {
            if written.contains(r.job_id()) {
                Checkpoint::Moved
            } else {
                Checkpoint::LeaseLost
            }
        })
        .collect())
}

/// The batchers a test may hold ([`GroupCommit::seam`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Model answers journaled under their keys.
    ModelAnswers,
    /// Reruns' reads of their journals.
    JournalReads,
}

/// A group-commit statement, named for tests that probe its locking
/// ([`GroupCommit::probe_batch_locks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKind {
    /// `delivered → acked`.
    Ack,
    /// `claimed → delivered → acked`, with the outbox row.
    Delivered,
    /// A model call's answer journaled under its key.
    ModelAnswer,
    /// `→ claimed`: the result, the outbox row, the history rows.
    CommitResult,
    /// A model call's journal row, fresh and in flight (or found).
    BeginCall,
    /// The heartbeat's lease renewal (one statement for a node's jobs).
    Renew,
}

impl<'a> GroupCommit<'a> {
    /// Test seam for the batches of `which`: hold them (while held,
    /// requests queue and no batch starts; the other kinds keep running,
    /// so jobs can be submitted and reach their model call meanwhile),
    /// count what waits, see the largest batch.
    #[doc(hidden)]
    pub fn seam(self, which: Held) -> super::group_commit::BatchSeam<'a> {
        match which {
            Held::ModelAnswers => self.0.batches.model_answer.seam(),
            Held::JournalReads => self.0.batches.journal.seam(),
        }
    }

    /// Test seam: runs the group-commit statement `kind` over `fences`
    /// (nothing need move: the statement locks its job rows first, whatever
    /// their state) inside a transaction, keeps it open for `hold`, then
    /// rolls it back. A test checks meanwhile which rows are locked.
    #[doc(hidden)]
    pub async fn probe_batch_locks(
        self,
        kind: BatchKind,
        fences: &[Fence],
        hold: std::time::Duration,
    ) -> Result<(), StoreError> {
        use diesel_async::AsyncConnection;
        let mut conn = self.db().conn().await?;
        let result = conn
            .transaction::<(), StoreError, _>(async |conn| {
                match kind {
                    BatchKind::Ack => {
                        let requests: Vec<Ack> =
                            fences.iter().map(|f| Ack { fence: f.clone() }).collect();
                        ack_on(conn, &requests).await?;
                    }
                    BatchKind::Delivered => {
                        let requests: Vec<Delivered> = fences
                            .iter()
                            .map(|f| Delivered {
                                fence: f.clone(),
                                key: crate::rules::keys::completed(&f.key()),
                                status: 200,
                            })
                            .collect();
                        delivered_on(conn, &requests).await?;
                    }
                    BatchKind::ModelAnswer => {
                        let requests: Vec<ModelAnswer> = fences
                            .iter()
                            .map(|f| ModelAnswer {
                                fence: f.clone(),
                                key: format!("probe:{}", f.job_id),
                                response: Value::Null,
                                usage: (None, None),
                            })
                            .collect();
                        model_answer_on(conn, &requests).await?;
                    }
                    BatchKind::CommitResult => {
                        let requests: Vec<CommitResult> = fences
                            .iter()
                            .map(|f| CommitResult {
                                fence: f.clone(),
                                from: "received",
                                passed: "generated,persisted,claimed".into(),
                                output: Value::Null,
                                event: crate::rules::keys::COMPLETED_EVENT.into(),
                                key: format!("probe:{}", f.job_id),
                                url: "http://127.0.0.1:9/".into(),
                                body: Value::Null,
                                in_flight_ms: None,
                                lease_ms: Some(30_000),
                                // (the probe's jobs are not leased: left as is)
                            })
                            .collect();
                        commit_result_on(conn, &requests).await?;
                    }
                    BatchKind::BeginCall => {
                        let requests: Vec<BeginCall> = fences
                            .iter()
                            .map(|f| BeginCall {
                                fence: f.clone(),
                                key: format!("probe:{}", f.job_id),
                                request_hash: "0".repeat(64),
                                in_flight_ms: 1000,
                            })
                            .collect();
                        begin_call_on(conn, &requests).await?;
                    }
                    BatchKind::Renew => {
                        let held: Vec<(String, i64)> =
                            fences.iter().map(|f| (f.job_id.clone(), f.epoch)).collect();
                        let node = fences.first().map_or("", |f| f.worker.as_str());
                        Store::renew_on(conn, node, &held, 1000).await?;
                    }
                }
                tokio::time::sleep(hold).await;
                Err(StoreError::Batch(BatchError::ProbeRolledBack))
            })
            .await;
        match result {
            Err(StoreError::Batch(BatchError::ProbeRolledBack)) => Ok(()),
            other => other,
        }
    }
}
