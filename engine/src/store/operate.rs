//! An operator's transitions: cancel (any live state → `cancelled`) and
//! redrive (`dead` → the last live state the job reached), each one
//! transaction with a history row saying who asked and why.

use diesel::sql_types::{BigInt, Jsonb, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl};

use super::rows::{parse_state, NEW_JOB_CHANNEL};
use super::sql::sql;
use super::Jobs;
use super::Store;
use crate::error::{ErrorEnvelope, StoreError};
use crate::rules::lifecycle::JobState;

/// What a cancel found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// The job was live and is `cancelled` now.
    Now,
    /// It was cancelled already (a repeat is a no-op).
    Already,
    /// It finished first (`acked` or `dead`): not cancelled.
    Finished(JobState),
    /// No such job.
    Missing,
    /// Its webhook was on the wire past the wait a cancel gives a send
    /// (see [`Jobs::cancel`]): not cancelled.
    Delivering,
}

/// What a redrive found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redriven {
    /// The job resumes at this state, with the same keys.
    Resumed(JobState),
    /// Only `dead` jobs can be redriven.
    NotDead(JobState),
    /// Its webhook's outcome is unknown (at-most-once): resending needs
    /// an explicit confirmation.
    UnknownDelivery,
    /// A tool call that may not run twice was sent and its answer lost:
    /// calling it again needs an explicit confirmation.
    UnknownToolCall,
    /// No such job.
    Missing,
}

#[derive(QueryableByName)]
struct TreeRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    incarnation: i32,
    #[diesel(sql_type = Text)]
    state: String,
}

#[derive(QueryableByName)]
struct StateRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempts: i32,
}

/// The channel a cancel is announced on (payload: the job id), so the node
/// running the job stops its attempt at once, wherever the attempt waits.
pub const CANCEL_CHANNEL: &str = super::rows::Channel::Cancelled.name();

impl Jobs<'_> {
    /// Cancels job `id` and its live descendants, in one transaction: any
    /// live state → `cancelled`. Each job's statement also bumps its lease
    /// epoch (an attempt still running is fenced out: it records nothing
    /// more and starts no new side effect) and closes an unsent webhook. A
    /// crash or a failed statement cancels nothing, and a cancel of a job
    /// cancelled already still cancels any descendant left live (a cascade
    /// cut short by an older node), so a repeat always finishes the tree.
    ///
    /// Rows are locked deepest first, the order in which a finishing child
    /// locks its parent (the `onceflow_child_finished` trigger); a child
    /// spawned before the parent's lock was taken is found by a second
    /// read under it, and none can be spawned after (the spawn holds the
    /// parent's fence, which the cancel bumps).
    pub async fn cancel(self, id: &str, by: &str, reason: &str) -> Result<Cancelled, StoreError> {
        // A webhook of the job on the wire (its outbox row claimed and in
        // flight) is let finish first: the cancel then finds the job acked
        // (and says so), or cancels it after a send that failed. Cancelling
        // under the send would record `cancelled` and a dead delivery while
        // the consumer holds `job.completed`. A send's time in flight is
        // bounded (the webhook timeout; a crashed node's mark lapses).
        let deadline = std::time::Instant::now() + CANCEL_WAITS_FOR_A_SEND;
        loop {
            match self.cancel_once(id, by, reason).await? {
                Cancelled::Delivering if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(25)).await;
                }
                done => return Ok(done),
            }
        }
    }

    async fn cancel_once(self, id: &str, by: &str, reason: &str) -> Result<Cancelled, StoreError> {
        retrying!(self, "cancel", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                let tree = Store::job_tree(conn, id, true).await?;
                let Some(root) = tree.iter().find(|j| j.id == id) else {
                    return Ok(Cancelled::Missing);
                };
                let cancelled = match parse_state(&root.state)? {
                    JobState::Cancelled => Cancelled::Already,
                    s if s.is_terminal() => Cancelled::Finished(s),
                    _ if Store::sending(conn, &root.id).await? => return Ok(Cancelled::Delivering),
                    _ => {
                        Store::cancel_one(conn, &root.id, root.incarnation, by, reason).await?;
                        Cancelled::Now
                    }
                };
                if matches!(cancelled, Cancelled::Now | Cancelled::Already) {
                    let why = format!("its parent job {id} was cancelled");
                    for job in Store::job_tree(conn, id, false).await? {
                        // A child whose webhook is on the wire is left to
                        // finish (it is acked in a moment, or a repeat of
                        // the cancel takes it).
                        if job.id != id
                            && !parse_state(&job.state)?.is_terminal()
                            && !Store::sending(conn, &job.id).await?
                        {
                            Store::cancel_one(conn, &job.id, job.incarnation, by, &why).await?;
                        }
                    }
                }
                Ok(cancelled)
            })
            .await
        })
        .await
    }

    /// Brings `dead` job `id` back to the last live state it reached, with
    /// the same keys: journaled model calls and tool calls replay, a
    /// persisted result is not regenerated. The retry budgets of the sends
    /// that failed start afresh. A webhook whose outcome is `unknown`
    /// (at-most-once) is sent again only with `confirm_unknown`. One
    /// transaction, the job row locked: two concurrent redrives resume it
    /// once (the second finds it no longer dead).
    pub async fn redrive(
        self,
        id: &str,
        by: &str,
        reason: &str,
        confirm_unknown: bool,
    ) -> Result<Redriven, StoreError> {
        let mut conn = self.db().conn().await?;
        conn.transaction::<_, StoreError, _>(async move |conn| {
            let rows: Vec<StateRow> =
                sql("SELECT state::text AS state, attempts FROM jobs WHERE id = $1 FOR UPDATE")
                    .bind::<Text, _>(id)
                    .load(conn)
                    .await?;
            let Some(job) = rows.into_iter().next() else {
                return Ok(Redriven::Missing);
            };
            let state = parse_state(&job.state)?;
            if state != JobState::Dead {
                return Ok(Redriven::NotDead(state));
            }
            #[derive(QueryableByName)]
            struct Outbox {
                #[diesel(sql_type = Text)]
                status: String,
            }
            let outbox: Vec<Outbox> =
                sql("SELECT status::text AS status FROM outbox WHERE job_id = $1 AND event = 'job.completed'")
                    .bind::<Text, _>(id)
                    .load(conn)
                    .await?;
            if outbox.iter().any(|o| o.status == "unknown") && !confirm_unknown {
                return Ok(Redriven::UnknownDelivery);
            }
            let unknown_calls: Vec<super::rows::IdRow> = sql(
                "SELECT job_id AS id FROM tool_calls WHERE job_id = $1 AND status = 'unknown'",
            )
            .bind::<Text, _>(id)
            .load(conn)
            .await?;
            if !unknown_calls.is_empty() && !confirm_unknown {
                return Ok(Redriven::UnknownToolCall);
            }
            // The last live state it reached (history is in order).
            let last: Vec<StateRow> = sql(
                "SELECT state::text AS state, attempt AS attempts FROM job_history \
                 WHERE job_id = $1 AND state NOT IN ('dead', 'cancelled') ORDER BY id DESC LIMIT 1",
            )
            .bind::<Text, _>(id)
            .load(conn)
            .await?;
            let resume = match last.into_iter().next() {
                Some(row) => parse_state(&row.state)?,
                None => JobState::Received,
            };
            sql(
                "UPDATE jobs SET state = $2::job_state, dead_reason = NULL, finished_at = NULL, \
                     run_at = now(), updated_at = now(), store_failures = 0 \
                 WHERE id = $1 AND state = 'dead'",
            )
            .bind::<Text, _>(id)
            .bind::<Text, _>(resume.as_str())
            .execute(conn)
            .await?;
            // Fresh budgets for the sends that failed; the same keys.
            sql(
                "UPDATE outbox SET status = 'claimed', attempts = 0, in_flight_until = NULL, \
                     in_flight_epoch = NULL, updated_at = now() \
                 WHERE job_id = $1 AND status IN ('dead', 'unknown') AND event = 'job.completed'",
            )
            .bind::<Text, _>(id)
            .execute(conn)
            .await?;
            sql(
                "UPDATE model_calls SET attempts = 0, in_flight_until = NULL, in_flight_epoch = NULL, \
                     updated_at = now() \
                 WHERE job_id = $1 AND status <> 'completed'",
            )
            .bind::<Text, _>(id)
            .execute(conn)
            .await?;
            sql(
                "UPDATE tool_calls SET status = 'started', attempts = 0, in_flight_until = NULL, \
                     in_flight_epoch = NULL \
                 WHERE job_id = $1 AND status IN ('failed', 'unknown')",
            )
            .bind::<Text, _>(id)
            .execute(conn)
            .await?;
            sql("DELETE FROM step_failures WHERE job_id = $1")
                .bind::<Text, _>(id)
                .execute(conn)
                .await?;
            sql(
                "INSERT INTO job_history (job_id, state, attempt, worker, note) \
                 VALUES ($1, $2::job_state, $3, $4, $5)",
            )
            .bind::<Text, _>(id)
            .bind::<Text, _>(resume.as_str())
            .bind::<diesel::sql_types::Integer, _>(job.attempts)
            .bind::<Text, _>(by)
            .bind::<Text, _>(format!("redrive: {reason}"))
            .execute(conn)
            .await?;
            sql("SELECT pg_notify($1, $2)")
                .bind::<Text, _>(NEW_JOB_CHANNEL)
                .bind::<Text, _>(id)
                .execute(conn)
                .await?;
            Ok(Redriven::Resumed(resume))
        })
        .await
    }

    /// The live jobs of `owner` (every token's with `None`), oldest
    /// first, in `state`, of `workflow` and with `tag` when given: at most
    /// `limit`.
    pub async fn live_ids(
        self,
        state: Option<JobState>,
        workflow: Option<&str>,
        tag: Option<(String, String)>,
        owner: Option<i64>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let mut conn = self.db().conn().await?;
        let rows: Vec<super::rows::IdRow> = sql(
            "SELECT id FROM jobs WHERE finished_at IS NULL \
               AND ($1::text IS NULL OR state::text = $1) \
               AND ($2::text IS NULL OR workflow = $2) AND ($3::bigint IS NULL OR owner_token = $3) \
               AND ($5::jsonb IS NULL OR (request ? 'tags' AND request->'tags' @> $5)) \
             ORDER BY created_at, id LIMIT $4",
        )
        .bind::<diesel::sql_types::Nullable<Text>, _>(state.map(JobState::as_str))
        .bind::<diesel::sql_types::Nullable<Text>, _>(workflow)
        .bind::<diesel::sql_types::Nullable<BigInt>, _>(owner)
        .bind::<BigInt, _>(limit)
        .bind::<diesel::sql_types::Nullable<Jsonb>, _>(tag.map(|(k, v)| serde_json::json!({ k: v })))
        .load(&mut conn)
        .await?;
        Ok(rows.into_iter().map(|r| r.id).collect())
    }

    /// The dead jobs of `owner` (every token's with `None`), oldest death
    /// first, of `workflow` when given: at most `limit`.
    pub async fn dead_ids(
        self,
        workflow: Option<&str>,
        owner: Option<i64>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let mut conn = self.db().conn().await?;
        let rows: Vec<super::rows::IdRow> = sql(
            "SELECT id FROM jobs WHERE state = 'dead' \
               AND ($1::text IS NULL OR workflow = $1) AND ($2::bigint IS NULL OR owner_token = $2) \
             ORDER BY finished_at LIMIT $3",
        )
        .bind::<diesel::sql_types::Nullable<Text>, _>(workflow)
        .bind::<diesel::sql_types::Nullable<BigInt>, _>(owner)
        .bind::<BigInt, _>(limit)
        .load(&mut conn)
        .await?;
        Ok(rows.into_iter().map(|r| r.id).collect())
    }
}

/// The longest a cancel waits for a webhook of its job on the wire.
const CANCEL_WAITS_FOR_A_SEND: std::time::Duration = std::time::Duration::from_secs(60);

impl Store {
    /// Whether a webhook of job `id` is on the wire now: its outbox row is
    /// claimed and marked in flight by the attempt sending it (the mark is
    /// written, fenced, before the request starts). Read under the job's
    /// row lock, which the claim's own statement takes too.
    async fn sending(
        conn: &mut diesel_async::AsyncPgConnection,
        id: &str,
    ) -> Result<bool, StoreError> {
        #[derive(diesel::QueryableByName)]
        struct Sending {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            sending: bool,
        }
        let found: Sending = sql(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE job_id = $1 AND status = 'claimed' \
                 AND in_flight_until > clock_timestamp()) AS sending",
        )
        .bind::<Text, _>(id)
        .get_result(conn)
        .await?;
        Ok(found.sending)
    }

    /// Job `id` and its descendants (its children, theirs, …), deepest
    /// first; `lock`: each row locked in that order.
    async fn job_tree(
        conn: &mut diesel_async::AsyncPgConnection,
        id: &str,
        lock: bool,
    ) -> Result<Vec<TreeRow>, StoreError> {
        // A child belongs to one life of its parent (`parent_incarnation`):
        // the tree of a job submitted again under a purged id holds none of
        // the old life's children. No depth bound: a link goes from a job to
        // one made after it, so the walk ends, and a cancel of a deep tree
        // must not stop short while it answers `cancelled`.
        macro_rules! tree {
            () => {
                "WITH RECURSIVE tree (id, incarnation, depth) AS ( \
                     SELECT id, incarnation, 0 FROM jobs WHERE id = $1 \
                     UNION ALL \
                     SELECT j.id, j.incarnation, t.depth + 1 FROM jobs j \
                     JOIN tree t ON j.parent_id = t.id AND j.parent_incarnation = t.incarnation) \
                 SELECT j.id, j.incarnation, j.state::text AS state \
                 FROM jobs j JOIN tree t ON t.id = j.id ORDER BY t.depth DESC, j.id"
            };
        }
        let query = if lock {
            sql(concat!(tree!(), " FOR NO KEY UPDATE OF j"))
        } else {
            sql(tree!())
        };
        Ok(query.bind::<Text, _>(id).load(conn).await?)
    }

    /// Cancels live job `id` (see [`cancel`](Self::cancel)); a finished one
    /// is left as it is.
    async fn cancel_one(
        conn: &mut diesel_async::AsyncPgConnection,
        id: &str,
        incarnation: i32,
        by: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        let error = serde_json::to_value(ErrorEnvelope {
            code: "cancelled".into(),
            message: format!("cancelled by {by}: {reason}"),
            retryable: false,
        })
        .expect("envelope serialises");
        let event_key = crate::rules::keys::failure(
            &crate::rules::keys::JobKey::new(id, incarnation),
            "cancelled",
        );
        let body = crate::rules::event::body(
            crate::rules::keys::CANCELLED_EVENT,
            serde_json::json!({ "job_id": id, "reason": reason, "by": by }),
            chrono::Utc::now(),
        );
        sql("WITH moved AS ( \
                 UPDATE jobs SET state = 'cancelled', finished_at = now(), updated_at = now(), \
                     lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL, lease_epoch = lease_epoch + 1, \
                     last_error = $3 \
                 WHERE id = $1 AND finished_at IS NULL \
                 RETURNING id, attempts, request, notify_failures), \
             event AS ( \
                 INSERT INTO outbox (job_id, event, idempotency_key, url, body) \
                 SELECT id, $5, $6, request->>'webhook_url', $8 \
                 FROM moved WHERE notify_failures \
                 ON CONFLICT DO NOTHING), \
             closed AS ( \
                 UPDATE outbox SET status = 'dead', in_flight_until = NULL, last_error = $3, \
                     run_at = 'infinity', updated_at = now() \
                 WHERE job_id IN (SELECT id FROM moved) AND status = 'claimed' AND event <> $5), \
             history AS ( \
                 INSERT INTO job_history (job_id, state, attempt, worker, note) \
                 SELECT id, 'cancelled', attempts, $2, $4 FROM moved) \
             SELECT pg_notify($7, id) FROM moved")
        .bind::<Text, _>(id)
        .bind::<Text, _>(by)
        .bind::<Jsonb, _>(&error)
        .bind::<Text, _>(reason)
        .bind::<Text, _>(crate::rules::keys::CANCELLED_EVENT)
        .bind::<Text, _>(&event_key)
        .bind::<Text, _>(CANCEL_CHANNEL)
        .bind::<Jsonb, _>(&body)
        .execute(conn)
        .await?;
        Ok(())
    }
}
