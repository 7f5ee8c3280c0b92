//! The tool ledger and the step journal: a side effect a workflow asked for
//! is recorded before it happens and its result after, so a replay returns
//! the stored result instead of doing it again.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use super::sql::sql;
use super::{Fence, Store};
use super::{Journal, Retention};
use crate::error::{ErrorEnvelope, StoreError};
use crate::rules::verdict::{decide_send, SendDecision, SendMode, SendRow};

/// One tool call's place in the conversation: its ledger identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// The model turn that asked for the call (0-based).
    pub turn: i32,
    /// The call's position within that turn's tool calls (0-based).
    pub index: i32,
}

/// A tool call as the model asked for it.
#[derive(Debug, Clone)]
pub struct ToolCallSpec<'a> {
    /// Where the call stands in the conversation: its ledger identity.
    pub position: Position,
    /// The provider's id of the call (recorded, not trusted to be unique).
    pub tool_call_id: &'a str,
    /// The tool asked for.
    pub tool_name: &'a str,
    /// The arguments the model gave.
    pub arguments: &'a Value,
    /// Their canonical SHA-256 (hex), compared on a replay.
    pub arguments_hash: &'a str,
    /// Whether a send whose answer was lost may be sent again (under the
    /// same key) or stops the job for a decision.
    pub mode: SendMode,
    /// The MCP server the call goes to (for its span and metrics; not
    /// stored).
    pub server: Option<&'a str>,
}

/// How a tool call's failure is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFailure {
    /// A later attempt executes it again.
    Retry,
    /// Never executed again (a redrive may).
    Permanent,
    /// It was sent and its answer lost, and it may not be sent twice: only a
    /// redrive with `confirm_unknown` sends it again.
    Unknown,
}

/// Where a tool call stands when an attempt is about to execute it.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCallStart {
    /// Done: return this result, byte for byte, and do not execute.
    Completed(String),
    /// Ours to execute; `attempt` counts executions started, this one included.
    Execute {
        /// Executions started, this one included.
        attempt: i32,
    },
    /// Another attempt sharing the lease is executing it until then: wait.
    InFlight {
        /// When the in-flight mark lapses.
        until: DateTime<Utc>,
    },
    /// This position was recorded for another call (id or arguments differ):
    /// a loud error, nothing is executed.
    Conflict {
        /// The tool-call id recorded at this position.
        stored_id: String,
        /// The arguments hash recorded at this position.
        stored_hash: String,
    },
    /// The lease is gone.
    LeaseLost,
    /// An at-most-once call was sent and its answer never recorded: it may
    /// have run, so it is not sent again without a person's decision.
    Unknown,
}

#[derive(QueryableByName)]
struct LedgerRow {
    #[diesel(sql_type = Text)]
    tool_call_id: String,
    #[diesel(sql_type = Text)]
    arguments_hash: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Nullable<Text>)]
    result: Option<String>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    in_flight_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    in_flight_epoch: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
    #[diesel(sql_type = Bool)]
    inserted: bool,
}

#[derive(QueryableByName)]
struct Output {
    #[diesel(sql_type = Text)]
    output: String,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// One key of a job's journal (see [`Journal::keys`]).
#[derive(Debug, Clone, QueryableByName)]
pub struct Journaled {
    /// The key.
    #[diesel(sql_type = Text)]
    pub key: String,
    /// A wait's outcome, once the wait is over.
    #[diesel(sql_type = Nullable<Jsonb>)]
    pub outcome: Option<Value>,
}

impl Journal<'_> {
    /// Records the intent to execute `call` (before any side effect) and
    /// decides whether this attempt executes it.
    pub async fn begin_tool_call(
        self,
        fence: &Fence,
        call: &ToolCallSpec<'_>,
        in_flight_ms: i64,
    ) -> Result<ToolCallStart, StoreError> {
        retrying!(self, "begin_tool_call", async || {
            self.begin_tool_call_once(fence, call, in_flight_ms).await
        })
        .await
    }

    async fn begin_tool_call_once(
        self,
        fence: &Fence,
        call: &ToolCallSpec<'_>,
        in_flight_ms: i64,
    ) -> Result<ToolCallStart, StoreError> {
        let mut conn = self.db().conn().await?;
        let result = conn
            .transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(ToolCallStart::LeaseLost);
                }
                let row: LedgerRow = sql(
                    "INSERT INTO tool_calls (job_id, tool_call_id, turn, call_index, tool_name, arguments_hash, \
                         arguments, attempts, in_flight_until, in_flight_epoch) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 1, clock_timestamp() + $8 * interval '1 millisecond', $9) \
                     ON CONFLICT (job_id, turn, call_index) DO UPDATE SET tool_name = tool_calls.tool_name \
                     RETURNING tool_call_id, arguments_hash, status::text AS status, result, attempts, \
                         in_flight_until, in_flight_epoch, clock_timestamp() AS now, (xmax = 0) AS inserted",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Text, _>(call.tool_call_id)
                .bind::<Integer, _>(call.position.turn)
                .bind::<Integer, _>(call.position.index)
                .bind::<Text, _>(call.tool_name)
                .bind::<Text, _>(call.arguments_hash)
                .bind::<Jsonb, _>(call.arguments)
                .bind::<BigInt, _>(in_flight_ms)
                .bind::<BigInt, _>(fence.epoch)
                .get_result(conn)
                .await?;
                if row.inserted {
                    return Ok(ToolCallStart::Execute { attempt: 1 });
                }
                // The position's identity is the call id and the arguments
                // together; either differing is another call.
                if row.tool_call_id != call.tool_call_id || row.arguments_hash != call.arguments_hash {
                    return Ok(ToolCallStart::Conflict {
                        stored_id: row.tool_call_id,
                        stored_hash: row.arguments_hash,
                    });
                }
                if row.status == "unknown" {
                    return Ok(ToolCallStart::Unknown);
                }
                let send = SendRow {
                    done: row.status == "completed" && row.result.is_some(),
                    in_flight_until: row.in_flight_until,
                    in_flight_epoch: row.in_flight_epoch,
                    now: row.now,
                };
                match decide_send(&send, fence.epoch, call.mode) {
                    SendDecision::Done => {
                        return Ok(ToolCallStart::Completed(row.result.expect("checked above")))
                    }
                    SendDecision::Wait { until } => return Ok(ToolCallStart::InFlight { until }),
                    SendDecision::Unknown => {
                        sql("UPDATE tool_calls SET status = 'unknown' WHERE job_id = $1 AND turn = $2 AND call_index = $3")
                            .bind::<Text, _>(&fence.job_id)
                            .bind::<Integer, _>(call.position.turn)
                            .bind::<Integer, _>(call.position.index)
                            .execute(conn)
                            .await?;
                        return Ok(ToolCallStart::Unknown);
                    }
                    SendDecision::Send => {}
                }
                sql(
                    "UPDATE tool_calls SET attempts = attempts + 1, status = 'started', \
                         in_flight_until = clock_timestamp() + $4 * interval '1 millisecond', in_flight_epoch = $5 \
                     WHERE job_id = $1 AND turn = $2 AND call_index = $3",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Integer, _>(call.position.turn)
                .bind::<Integer, _>(call.position.index)
                .bind::<BigInt, _>(in_flight_ms)
                .bind::<BigInt, _>(fence.epoch)
                .execute(conn)
                .await?;
                Ok(ToolCallStart::Execute {
                    attempt: row.attempts + 1,
                })
            })
            .await?;
        Ok(result)
    }

    /// Stores a tool call's result; false when the lease is lost.
    pub async fn complete_tool_call(
        self,
        fence: &Fence,
        position: Position,
        result: &str,
    ) -> Result<bool, StoreError> {
        if result.contains('\0') {
            return Err(StoreError::InvalidData(
                "the tool's result contains a NUL character".into(),
            ));
        }
        retrying!(self, "complete_tool_call", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(false);
                }
                sql(
                    "UPDATE tool_calls SET status = 'completed', result = $4, completed_at = now(), \
                         in_flight_until = NULL, in_flight_epoch = NULL, last_error = NULL \
                     WHERE job_id = $1 AND turn = $2 AND call_index = $3 AND status <> 'completed'",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Integer, _>(position.turn)
                .bind::<Integer, _>(position.index)
                .bind::<Text, _>(result)
                .execute(conn)
                .await?;
                Ok(true)
            })
            .await
        })
        .await
    }

    /// Records a failed execution and frees the call for the next attempt.
    /// Fenced: false (nothing written) when the lease is lost.
    pub async fn fail_tool_call(
        self,
        fence: &Fence,
        position: Position,
        error: &ErrorEnvelope,
        failure: ToolFailure,
    ) -> Result<bool, StoreError> {
        let error = serde_json::to_value(error).expect("envelope serialises");
        let status = match failure {
            ToolFailure::Retry => None,
            ToolFailure::Permanent => Some("failed"),
            ToolFailure::Unknown => Some("unknown"),
        };
        retrying!(self, "fail_tool_call", async || {
            let mut conn = self.db().conn().await?;
            let held: Vec<super::rows::IdRow> = sql(
                "WITH fence AS MATERIALIZED ( \
                     SELECT id FROM jobs WHERE id = $1 AND lease_epoch = $6 FOR NO KEY UPDATE), \
                 failed AS ( \
                     UPDATE tool_calls t SET last_error = $4, in_flight_until = NULL, in_flight_epoch = NULL, \
                         status = COALESCE($5::tool_call_status, t.status) \
                     FROM fence WHERE t.job_id = fence.id AND t.turn = $2 AND t.call_index = $3 \
                       AND t.status <> 'completed') \
                 SELECT id FROM fence",
            )
            .bind::<Text, _>(&fence.job_id)
            .bind::<Integer, _>(position.turn)
            .bind::<Integer, _>(position.index)
            .bind::<Jsonb, _>(&error)
            .bind::<Nullable<Text>, _>(status)
            .bind::<BigInt, _>(fence.epoch)
            .load(&mut conn)
            .await?;
            Ok(held.len() == 1)
        })
        .await
    }

    /// Every key journaled for `fence`'s job (model calls, tool calls,
    /// steps, waits), in the order they were first journaled: what a replay of the
    /// body must ask for again, in this order, before it asks anything new.
    /// A wait that is over comes with its outcome, which a replay returns
    /// as it stands.
    pub async fn keys(self, fence: &Fence) -> Result<Vec<Journaled>, StoreError> {
        // Batched: a node that resumes many jobs at once (a timer burst, a
        // restart) reads their journals in a few statements, not one each.
        let request = super::group_writes::JournalRead {
            fence: fence.clone(),
        };
        let keys = (self.batches.journal)
            .call_retrying(&self, "journal_keys", request)
            .await?;
        Ok(keys
            .into_iter()
            .map(|(key, outcome)| Journaled { key, outcome })
            .collect())
    }

    /// Begins step `key` under the attempt's fence, before its work runs:
    /// the journaled output when the step already ran (`Some(Some(..))`),
    /// `Some(None)` when this attempt is to run it, and `None` when the
    /// attempt no longer holds the job (cancelled or taken over), so the
    /// work must not run. The job's row is locked as every fenced write
    /// locks it, so a cancel or takeover either commits before this (and
    /// the step is refused) or waits for it.
    pub async fn begin_step(
        self,
        fence: &Fence,
        key: &str,
    ) -> Result<Option<Option<String>>, StoreError> {
        retrying!(self, "begin_step", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(None);
                }
                let rows: Vec<Output> =
                    sql("SELECT output FROM steps WHERE job_id = $1 AND step_key = $2")
                        .bind::<Text, _>(&fence.job_id)
                        .bind::<Text, _>(key)
                        .load(conn)
                        .await?;
                Ok(Some(rows.into_iter().next().map(|r| r.output)))
            })
            .await
        })
        .await
    }

    /// Counts a retryable failure under `key` (a step's, or a body's own
    /// named by `ctx.retry`) under the attempt's fence: how many times it
    /// has now failed (its spent retry budget), or `None` when the attempt
    /// no longer holds the job. Counted per key, not per job attempt: waits
    /// and other keys spend none of it.
    pub async fn count_failure(self, fence: &Fence, key: &str) -> Result<Option<u32>, StoreError> {
        #[derive(QueryableByName)]
        struct Failures {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            failures: i32,
        }
        retrying!(self, "count_failure", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(None);
                }
                let row: Failures = sql(
                    "INSERT INTO step_failures (job_id, step_key, failures) VALUES ($1, $2, 1) \
                     ON CONFLICT (job_id, step_key) DO UPDATE \
                         SET failures = step_failures.failures + 1, last_failed_at = now() \
                     RETURNING failures",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Text, _>(key)
                .get_result(conn)
                .await?;
                Ok(Some(u32::try_from(row.failures).unwrap_or(u32::MAX)))
            })
            .await
        })
        .await
    }

    /// Journals step `key`'s output; returns what is stored (the first writer
    /// wins a race), or `None` when the lease is lost.
    pub async fn record_step(
        self,
        fence: &Fence,
        key: &str,
        output: &str,
    ) -> Result<Option<String>, StoreError> {
        retrying!(self, "record_step", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(None);
                }
                let stored: Output = sql(
                    "INSERT INTO steps (job_id, step_key, output) VALUES ($1, $2, $3) \
                     ON CONFLICT (job_id, step_key) DO UPDATE SET output = steps.output \
                     RETURNING output",
                )
                .bind::<Text, _>(&fence.job_id)
                .bind::<Text, _>(key)
                .bind::<Text, _>(output)
                .get_result(conn)
                .await?;
                Ok(Some(stored.output))
            })
            .await
        })
        .await
    }
}

impl Retention<'_> {
    /// Deletes up to `batch` jobs that finished more than `retention_ms` ago,
    /// with their history, results, journals and keys (foreign keys cascade).
    /// After this, a submission of one of their ids is a new job.
    pub async fn purge_finished(self, retention_ms: i64, batch: i64) -> Result<u64, StoreError> {
        self.purge_finished_keeping_dead(retention_ms, retention_ms, batch)
            .await
    }

    /// As [`purge_finished`](Self::purge_finished), with dead letters kept
    /// for `dead_retention_ms` instead (an operator may still redrive them).
    pub async fn purge_finished_keeping_dead(
        self,
        retention_ms: i64,
        dead_retention_ms: i64,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = self.db().conn().await?;
        Store::purge_in(&mut conn, retention_ms, dead_retention_ms, batch).await
    }

    /// How long until the oldest finished job's retention ends (dead
    /// letters are kept `dead_retention_ms`, the others `retention_ms`), by
    /// the database's clock: when the next purge is due. Zero when one is
    /// past due (a child kept for its parent, or a batch not yet run);
    /// `None` when no job has finished. Two index reads: `jobs_finished`
    /// from its oldest end, `jobs_dead`.
    pub async fn next_purge_in(
        self,
        retention_ms: i64,
        dead_retention_ms: i64,
    ) -> Result<Option<std::time::Duration>, StoreError> {
        #[derive(QueryableByName)]
        struct Next {
            #[diesel(sql_type = Nullable<BigInt>)]
            ms: Option<i64>,
        }
        let mut conn = self.db().conn().await?;
        let next: Next = sql(
            "SELECT ceil(extract(epoch FROM least( \
                 (SELECT min(finished_at) FROM jobs WHERE finished_at IS NOT NULL AND state <> 'dead') \
                     + $1 * interval '1 millisecond', \
                 (SELECT min(finished_at) FROM jobs WHERE dead_reason IS NOT NULL) \
                     + $2 * interval '1 millisecond') - now()) * 1000)::bigint AS ms",
        )
        .bind::<BigInt, _>(retention_ms)
        .bind::<BigInt, _>(dead_retention_ms)
        .get_result(&mut conn)
        .await?;
        Ok(next
            .ms
            .map(|ms| std::time::Duration::from_millis(ms.max(0) as u64)))
    }

    /// How many jobs are in each live state and how many are dead (zeros
    /// included): the `onceflow.jobs` gauge. Acked and cancelled jobs are
    /// not counted: they are most of a table that keeps a day of finished
    /// jobs, and counting them would cost a read of all of it at every
    /// refresh. This reads only live rows (through `jobs_runnable`, whose
    /// predicate is `finished_at IS NULL`) and dead ones (through
    /// `jobs_dead`, `dead_reason IS NOT NULL`, which only dead rows have),
    /// so its cost follows the backlog and the dead letters, not retention.
    /// (`GET /v1/stats` still counts every state, on request.)
    pub async fn count_live_and_dead(
        self,
    ) -> Result<Vec<(crate::rules::lifecycle::JobState, u64)>, StoreError> {
        use super::jobs::{per_state, StateCount};
        use crate::rules::lifecycle::JobState;
        let mut conn = self.db().conn().await?;
        let rows: Vec<StateCount> = sql(
            "SELECT state::text AS state, count(*) AS n FROM jobs WHERE finished_at IS NULL GROUP BY state \
             UNION ALL \
             SELECT 'dead', count(*) FROM jobs WHERE dead_reason IS NOT NULL",
        )
        .load(&mut conn)
        .await?;
        per_state(
            JobState::ALL
                .into_iter()
                .filter(|s| !s.is_terminal() || *s == JobState::Dead),
            rows,
        )
    }

    /// Unfinished jobs in all, and of API token `owner` (0 for `None`).
    pub async fn backlog(self, owner: Option<i64>) -> Result<(u64, u64), StoreError> {
        #[derive(QueryableByName)]
        struct Counts {
            #[diesel(sql_type = BigInt)]
            total: i64,
            #[diesel(sql_type = BigInt)]
            mine: i64,
        }
        let mut conn = self.db().conn().await?;
        let c: Counts = sql(
            "SELECT count(*) AS total, count(*) FILTER (WHERE owner_token = $1) AS mine \
             FROM jobs WHERE finished_at IS NULL",
        )
        .bind::<Nullable<BigInt>, _>(owner)
        .get_result(&mut conn)
        .await?;
        Ok((c.total.max(0) as u64, c.mine.max(0) as u64))
    }

    /// Live jobs whose `name@version` is not in `workflows` (this node cannot
    /// run them: another workflow, or a version it does not have).
    pub async fn count_unrunnable(self, workflows: &[String]) -> Result<u64, StoreError> {
        let mut conn = self.db().conn().await?;
        let found: Count = sql(
            "SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL AND NOT (workflow || '@' || workflow_version = ANY($1))",
        )
        .bind::<diesel::sql_types::Array<Text>, _>(workflows)
        .get_result(&mut conn)
        .await?;
        Ok(found.n.max(0) as u64)
    }
}

impl Store {
    async fn purge_in(
        conn: &mut AsyncPgConnection,
        retention_ms: i64,
        dead_retention_ms: i64,
        batch: i64,
    ) -> Result<u64, StoreError> {
        // Each purged id leaves a tombstone (its incarnation and last lease
        // epoch), so a resubmission is a new incarnation with keys of its own
        // and epochs that continue. A child job stays while its parent is
        // live or dead (a redrive): the parent's replay must find it, not
        // start it again. A parent stays while a child of its life is live:
        // its id is not free for another job (another token's, perhaps)
        // while that child runs, and its owner still sees and cancels the
        // child through it. A job stamped with a throttle's start stays while
        // its period runs: its row is what counts the start.
        let purged: Count = sql("WITH gone AS ( \
                 DELETE FROM jobs WHERE id IN ( \
                     SELECT id FROM jobs \
                     WHERE finished_at < now() - least($1, $3) * interval '1 millisecond' \
                       AND finished_at < now() - (CASE WHEN state = 'dead' THEN $3 ELSE $1 END) \
                           * interval '1 millisecond' \
                       AND NOT EXISTS (SELECT 1 FROM jobs p WHERE p.id = jobs.parent_id \
                           AND p.incarnation = jobs.parent_incarnation \
                           AND (p.finished_at IS NULL OR p.state = 'dead')) \
                       AND NOT EXISTS (SELECT 1 FROM jobs c WHERE c.parent_id = jobs.id \
                           AND c.parent_incarnation = jobs.incarnation AND c.finished_at IS NULL) \
                       AND (throttle_at IS NULL \
                           OR throttle_at <= now() - make_interval(secs => throttle_period_s)) \
                     ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 RETURNING id, incarnation, lease_epoch), \
             tombstones AS ( \
                 INSERT INTO job_tombstones (id, incarnation, last_epoch) \
                 SELECT id, incarnation, lease_epoch FROM gone \
                 ON CONFLICT (id) DO UPDATE SET incarnation = EXCLUDED.incarnation, \
                     last_epoch = EXCLUDED.last_epoch, purged_at = now()) \
             SELECT count(*) AS n FROM gone")
        .bind::<BigInt, _>(retention_ms)
        .bind::<BigInt, _>(batch)
        .bind::<BigInt, _>(dead_retention_ms)
        .get_result(conn)
        .await?;
        Ok(purged.n as u64)
    }
}
