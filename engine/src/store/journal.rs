//! The journal: model calls, results and the webhook outbox. Each write that
//! stands for a state commits atomically with its checkpoint.
//!
//! The hot path is one statement per checkpoint (autocommit, so one round
//! trip and one commit): the lease fence, the data, the state move and its
//! history rows are a single data-modifying statement that locks the job row
//! first, as every journal write does. `delivered`, `acked` and model answers
//! go through the group commit of `group_commit`: one such statement for all the
//! jobs waiting at that moment. The `BeforeCommit` failpoints of these
//! writes are hit just before the statement: a crash or failure there leaves
//! nothing written, exactly as a crash before the commit would.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use super::rows::IdRow;
use super::sql::sql;
use super::Journal;
use super::{Checkpoint, Fence, Store};
use crate::error::{ErrorEnvelope, StoreError};
use crate::faults::{FailPoint, Faults};
use crate::rules::lifecycle::JobState;
use crate::rules::verdict::{decide_send, OutboxStatus, SendDecision, SendMode, SendRow};

/// Where a model call stands when an attempt is about to make it.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelCallStart {
    /// Journaled: return this response, do not call the model.
    Completed(Value),
    /// Ours to send; `attempt` counts tries of this key, this one included.
    Send {
        /// Sends of this key so far, this one included.
        attempt: i32,
    },
    /// Another attempt has this request in flight until then: wait, do not send.
    InFlight {
        /// When the in-flight mark lapses.
        until: DateTime<Utc>,
    },
    /// The key was journaled for a different request: a loud error.
    KeyConflict {
        /// The SHA-256 (hex) of the request journaled under the key.
        stored_hash: String,
    },
    /// The lease is gone.
    LeaseLost,
}

/// Where a webhook delivery stands when an attempt is about to send it.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryStart {
    /// Already delivered (2xx recorded).
    Delivered,
    /// Ours to send.
    Send {
        /// Sends of this webhook so far, this one included.
        attempt: i32,
        /// The job's `webhook_url`.
        url: String,
        /// The webhook payload, as claimed.
        body: Value,
    },
    /// Another attempt has the POST in flight until then.
    InFlight {
        /// When the in-flight mark lapses.
        until: DateTime<Utc>,
    },
    /// At-most-once, and an earlier send's outcome was never recorded: the row
    /// is now `unknown` and must not be sent again.
    Unknown,
    /// Dead or unknown already.
    Closed(String),
    /// The lease is gone.
    LeaseLost,
}

/// The completion event to claim: its UNIQUE key, where it goes and what it says.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The event name (`job.completed`).
    pub event: &'a str,
    /// The webhook's idempotency key (`job:{id}:completed`).
    pub key: &'a str,
    /// The job's `webhook_url`.
    pub url: &'a str,
    /// The payload to send.
    pub body: &'a Value,
    /// How long the claimant's first send is marked in flight; `None` leaves
    /// the row unsent (at-most-once marks each send only as it starts).
    pub in_flight_ms: Option<i64>,
    /// When set, the commit also extends the job's lease to at least this
    /// long from the commit: until half of it has passed, the claimant's
    /// first send needs no further fenced read (no other attempt can take
    /// a job whose lease has not expired; a cancel stops the attempt).
    pub lease_ms: Option<i64>,
}

/// What a failed send records on its model-call or outbox row.
#[derive(Debug, Clone)]
pub struct FailedSend {
    /// The failure, stored as the row's `last_error`.
    pub error: ErrorEnvelope,
    /// The HTTP status, when the server answered.
    pub status: Option<i32>,
}

enum TxError {
    Store(StoreError),
    Abort(Checkpoint),
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        TxError::Store(StoreError::Query(e))
    }
}

impl From<StoreError> for TxError {
    fn from(e: StoreError) -> Self {
        TxError::Store(e)
    }
}

/// Hits the `BeforeCommit` failpoints of a one-statement write, in order.
async fn before_commit(faults: &Faults, job_id: &str, points: &[&'static str]) -> bool {
    for point in points {
        if faults
            .hit(job_id, FailPoint::BeforeCommit(point))
            .await
            .is_err()
        {
            return false;
        }
    }
    true
}

fn finish(result: Result<(), TxError>) -> Result<Checkpoint, StoreError> {
    match result {
        Ok(()) => Ok(Checkpoint::Moved),
        Err(TxError::Abort(c)) => Ok(c),
        Err(TxError::Store(e)) => Err(e),
    }
}

async fn guard(conn: &mut AsyncPgConnection, fence: &Fence) -> Result<(), TxError> {
    if Store::hold_fence(conn, fence).await? {
        Ok(())
    } else {
        Err(TxError::Abort(Checkpoint::LeaseLost))
    }
}

impl From<super::group_writes::CallRow> for ModelCallRow {
    fn from(r: super::group_writes::CallRow) -> Self {
        ModelCallRow {
            request_hash: r.request_hash,
            status: r.status,
            response: r.response,
            attempts: r.attempts,
            in_flight_until: r.in_flight_until,
            in_flight_epoch: r.in_flight_epoch,
            now: r.now,
            inserted: r.inserted,
        }
    }
}

#[derive(QueryableByName)]
struct ModelCallRow {
    #[diesel(sql_type = Text)]
    request_hash: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Nullable<Jsonb>)]
    response: Option<Value>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    in_flight_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    in_flight_epoch: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
    /// The row was created by this statement (Postgres' `xmax = 0` test).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    inserted: bool,
}

#[derive(QueryableByName)]
struct OutboxRow {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Text)]
    url: String,
    #[diesel(sql_type = Jsonb)]
    body: Value,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    in_flight_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    in_flight_epoch: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct OutputRow {
    #[diesel(sql_type = Jsonb)]
    output: Value,
}

use crate::rules::payload::contains_nul;

/// What a failed send does besides recording itself.
#[derive(Debug, Clone, Copy)]
pub struct KillWith<'a> {
    /// The job's `dead_reason`.
    pub reason: &'a str,
    /// The outbox row's final status (`dead` or `unknown`).
    pub outbox_status: OutboxStatus,
}

impl Journal<'_> {
    /// Journals the intent to call the model under `key` (before anything is
    /// sent) and decides whether this attempt sends. Waits for a concurrent
    /// attempt that is committing this key's response.
    pub async fn begin_model_call(
        self,
        fence: &Fence,
        key: &str,
        request_hash: &str,
        in_flight_ms: i64,
    ) -> Result<ModelCallStart, StoreError> {
        retrying!(self, "begin_model_call", async || {
            self.begin_model_call_once(fence, key, request_hash, in_flight_ms)
                .await
        })
        .await
    }

    async fn begin_model_call_once(
        self,
        fence: &Fence,
        key: &str,
        request_hash: &str,
        in_flight_ms: i64,
    ) -> Result<ModelCallStart, StoreError> {
        // The common case in one statement, group-committed with the other
        // jobs' of the moment: the fenced insert of a fresh row, born in
        // flight for us. An existing row that holds another request or is
        // completed is final; anything else is decided under locks.
        let found = self
            .batches
            .begin_call
            .call(super::group_writes::BeginCall {
                fence: fence.clone(),
                key: key.to_owned(),
                request_hash: request_hash.to_owned(),
                in_flight_ms,
            })
            .await?;
        if let Some(row) = found.as_ref().filter(|r| r.job_id != fence.job_id) {
            // Ids may contain `:`, so two jobs' keys can spell the same
            // string; a row of another job is never this job's answer.
            return Ok(ModelCallStart::KeyConflict {
                stored_hash: row.request_hash.clone(),
            });
        }
        let rows: Vec<ModelCallRow> = found.map(ModelCallRow::from).into_iter().collect();
        match rows.into_iter().next() {
            None => return Ok(ModelCallStart::LeaseLost),
            Some(row) if row.inserted => return Ok(ModelCallStart::Send { attempt: 1 }),
            // The request is the key's identity, whatever the row's status: a
            // completed call never answers a different prompt.
            Some(row) if row.request_hash != request_hash => {
                return Ok(ModelCallStart::KeyConflict {
                    stored_hash: row.request_hash,
                })
            }
            Some(ModelCallRow {
                status,
                response: Some(response),
                ..
            }) if status == "completed" => return Ok(ModelCallStart::Completed(response)),
            Some(_) => {}
        }
        let mut conn = self.db().conn().await?;
        let result = conn
            .transaction::<_, TxError, _>(async move |conn| {
                {
                    guard(conn, fence).await?;
                    // Locks the existing row (waiting for an attempt that is
                    // writing it) and returns it as stored.
                    let row: ModelCallRow = sql(
                        "SELECT request_hash, status::text AS status, response, attempts, in_flight_until, \
                             in_flight_epoch, clock_timestamp() AS now, false AS inserted \
                         FROM model_calls WHERE idempotency_key = $1 FOR UPDATE",
                    )
                    .bind::<Text, _>(key)
                    .get_result(conn)
                    .await?;
                    if row.request_hash != request_hash {
                        return Ok(ModelCallStart::KeyConflict {
                            stored_hash: row.request_hash,
                        });
                    }
                    let send = SendRow {
                        done: row.status == "completed" && row.response.is_some(),
                        in_flight_until: row.in_flight_until,
                        in_flight_epoch: row.in_flight_epoch,
                        now: row.now,
                    };
                    Ok(match decide_send(&send, fence.epoch, SendMode::AtLeastOnce) {
                        SendDecision::Done => {
                            ModelCallStart::Completed(row.response.expect("checked above"))
                        }
                        SendDecision::Wait { until } => ModelCallStart::InFlight { until },
                        SendDecision::Send | SendDecision::Unknown => {
                            sql(
                                "UPDATE model_calls SET attempts = attempts + 1, status = 'pending', \
                                     in_flight_until = clock_timestamp() + $2 * interval '1 millisecond', \
                                     in_flight_epoch = $3, updated_at = now() \
                                 WHERE idempotency_key = $1",
                            )
                            .bind::<Text, _>(key)
                            .bind::<BigInt, _>(in_flight_ms)
                            .bind::<BigInt, _>(fence.epoch)
                            .execute(conn)
                            .await?;
                            ModelCallStart::Send {
                                attempt: row.attempts + 1,
                            }
                        }
                    })
                }
            })
            .await;
        match result {
            Ok(start) => Ok(start),
            Err(TxError::Abort(_)) => Ok(ModelCallStart::LeaseLost),
            Err(TxError::Store(e)) => Err(e),
        }
    }

    /// Journals the model's response under `key`.
    pub async fn complete_model_call(
        self,
        fence: &Fence,
        key: &str,
        response: &Value,
        usage: (Option<i32>, Option<i32>),
        faults: &Faults,
    ) -> Result<Checkpoint, StoreError> {
        if contains_nul(response) {
            return Err(StoreError::InvalidData(
                "the model's response contains a NUL character (\\u0000)".into(),
            ));
        }
        if usage.0.is_some_and(|n| n < 0) || usage.1.is_some_and(|n| n < 0) {
            return Err(StoreError::InvalidData(format!(
                "the model's response reports negative token usage ({:?}, {:?})",
                usage.0, usage.1
            )));
        }
        if !before_commit(faults, &fence.job_id, &["model_call"]).await {
            return Ok(Checkpoint::Faulted);
        }
        // Fenced (the job row locked at the epoch first), and group-committed
        // with the answers of other jobs arriving at the same moment.
        let answer = super::group_writes::ModelAnswer {
            fence: fence.clone(),
            key: key.to_owned(),
            response: response.clone(),
            usage,
        };
        (self.batches.model_answer)
            .call_retrying(&self, "complete_model_call", answer)
            .await
    }

    /// Records a failed send of `key` and frees it for the next attempt.
    /// Fenced: false (nothing written) when the lease is lost, so a zombie
    /// never clears a newer attempt's in-flight mark.
    pub async fn fail_model_call(
        self,
        fence: &Fence,
        key: &str,
        failed: &FailedSend,
    ) -> Result<bool, StoreError> {
        let error = serde_json::to_value(&failed.error).expect("envelope serialises");
        retrying!(self, "fail_model_call", async || {
            let mut conn = self.db().conn().await?;
            let held: Vec<IdRow> = sql(
                "WITH fence AS MATERIALIZED ( \
                     SELECT id FROM jobs WHERE id = $1 AND lease_epoch = $2 FOR NO KEY UPDATE), \
                 failed AS ( \
                     UPDATE model_calls m SET last_error = $4, last_status = $5, in_flight_until = NULL, \
                         in_flight_epoch = NULL, updated_at = now() \
                     FROM fence WHERE m.job_id = fence.id AND m.idempotency_key = $3 \
                       AND m.status <> 'completed') \
                 SELECT id FROM fence",
            )
            .bind::<Text, _>(&fence.job_id)
            .bind::<BigInt, _>(fence.epoch)
            .bind::<Text, _>(key)
            .bind::<Jsonb, _>(&error)
            .bind::<Nullable<Integer>, _>(failed.status)
            .load(&mut conn)
            .await?;
            Ok(held.len() == 1)
        })
        .await
    }

    /// The persisted result of a job.
    pub async fn result_of(self, job_id: &str) -> Result<Option<Value>, StoreError> {
        retrying!(self, "result_of", async || {
            let mut conn = self.db().conn().await?;
            let rows: Vec<OutputRow> = sql("SELECT output FROM results WHERE job_id = $1")
                .bind::<Text, _>(job_id)
                .load(&mut conn)
                .await?;
            Ok(rows.into_iter().next().map(|r| r.output))
        })
        .await
    }

    /// Commits the workflow's output and the claim of its completion event,
    /// moving the job from `from` (`received`, `generated` or `persisted`)
    /// through every state up to `claimed` in one statement: one guarded
    /// move, a history row per state passed, and the data those states stand
    /// for, so they share one commit (one fsync).
    ///
    /// * `received → generated`: the body returned; its model calls are journaled.
    /// * `generated → persisted`: the result row (one per job) is written.
    /// * `persisted → claimed`: the outbox row under its UNIQUE key is
    ///   inserted, with its first send marked in flight for this attempt:
    ///   on `Moved` the caller sends attempt 1 at once.
    pub async fn commit_result(
        self,
        fence: &Fence,
        from: JobState,
        output: &Value,
        claim: &Claim<'_>,
        faults: &Faults,
    ) -> Result<Checkpoint, StoreError> {
        let passed: Vec<&'static str> = JobState::ALL
            .into_iter()
            .filter(|s| *s > from && *s <= JobState::Claimed)
            .map(JobState::as_str)
            .collect();
        debug_assert!(
            !passed.is_empty() && !passed.contains(&"dead"),
            "commit_result from {from}: only received, generated and persisted move to claimed"
        );
        if contains_nul(output) {
            return Err(StoreError::InvalidData(
                "the workflow's output contains a NUL character (\\u0000)".into(),
            ));
        }
        if !before_commit(faults, &fence.job_id, &passed).await {
            return Ok(Checkpoint::Faulted);
        }
        // The guarded move (the job row locked first), the result, the
        // outbox row and the history rows: one statement, group-committed
        // with other jobs'.
        let request = super::group_writes::CommitResult {
            fence: fence.clone(),
            from: from.as_str(),
            passed: passed.join(","),
            output: output.clone(),
            event: claim.event.to_owned(),
            key: claim.key.to_owned(),
            url: claim.url.to_owned(),
            body: claim.body.clone(),
            in_flight_ms: claim.in_flight_ms,
            lease_ms: claim.lease_ms,
        };
        (self.batches.commit_result)
            .call_retrying(&self, "commit_result", request)
            .await
    }

    /// Decides whether this attempt POSTs the webhook under `key`, and marks
    /// the send in flight before anything leaves. Under at-most-once, a
    /// send whose outcome was never recorded turns the row `unknown` and the
    /// job `dead` in the same transaction; a row found closed (`dead`,
    /// `unknown`) under a live job closes the job too, so no attempt can
    /// loop on it.
    pub async fn begin_delivery(
        self,
        fence: &Fence,
        key: &str,
        at_most_once: bool,
        in_flight_ms: i64,
    ) -> Result<DeliveryStart, StoreError> {
        retrying!(self, "begin_delivery", async || {
            self.begin_delivery_once(fence, key, at_most_once, in_flight_ms)
                .await
        })
        .await
    }

    async fn begin_delivery_once(
        self,
        fence: &Fence,
        key: &str,
        at_most_once: bool,
        in_flight_ms: i64,
    ) -> Result<DeliveryStart, StoreError> {
        let mode = if at_most_once {
            SendMode::AtMostOnce
        } else {
            SendMode::AtLeastOnce
        };
        let mut conn = self.db().conn().await?;
        let result = conn
            .transaction::<_, TxError, _>(async move |conn| {
                {
                    guard(conn, fence).await?;
                    let row: OutboxRow = sql(
                        "SELECT status::text AS status, url, body, attempts, in_flight_until, in_flight_epoch, clock_timestamp() AS now \
                         FROM outbox WHERE idempotency_key = $1 FOR UPDATE",
                    )
                    .bind::<Text, _>(key)
                    .get_result(conn)
                    .await?;
                    if row.status != "claimed" && row.status != "delivered" {
                        // Closed, yet the job is live (written by an older
                        // build, or by hand): close the job with it.
                        let error = ErrorEnvelope {
                            code: format!("delivery_{}", row.status),
                            message: format!("the outbox row {key} is {}", row.status),
                            retryable: false,
                        };
                        let reason = format!("the completion event is {}", row.status);
                        match Store::kill_in(conn, fence, &reason, &error).await? {
                            Checkpoint::Moved | Checkpoint::AlreadyAt(_) => {}
                            other => return Err(TxError::Abort(other)),
                        }
                        return Ok(DeliveryStart::Closed(row.status));
                    }
                    let send = SendRow {
                        done: row.status == "delivered",
                        in_flight_until: row.in_flight_until,
                        in_flight_epoch: row.in_flight_epoch,
                        now: row.now,
                    };
                    Ok(match decide_send(&send, fence.epoch, mode) {
                        SendDecision::Done => DeliveryStart::Delivered,
                        SendDecision::Wait { until } => DeliveryStart::InFlight { until },
                        SendDecision::Unknown => {
                            // A send started and its outcome was never
                            // recorded: the row and the job close together.
                            let error = ErrorEnvelope {
                                code: "delivery_unknown".into(),
                                message: format!(
                                    "a send of {key} may have reached the consumer but its outcome was never \
                                     recorded; the workflow delivers at most once, so it is not sent again"
                                ),
                                retryable: false,
                            };
                            sql(
                                "UPDATE outbox SET status = 'unknown', last_error = $2, in_flight_until = NULL, \
                                     updated_at = now() WHERE idempotency_key = $1",
                            )
                            .bind::<Text, _>(key)
                            .bind::<Jsonb, _>(serde_json::to_value(&error).expect("envelope serialises"))
                            .execute(conn)
                            .await?;
                            let reason = "delivery outcome unknown (at-most-once): needs a human";
                            match Store::kill_in(conn, fence, reason, &error).await? {
                                Checkpoint::Moved => DeliveryStart::Unknown,
                                other => return Err(TxError::Abort(other)),
                            }
                        }
                        SendDecision::Send => {
                            sql(
                                "UPDATE outbox SET attempts = attempts + 1, updated_at = now(), \
                                     in_flight_until = clock_timestamp() + $2 * interval '1 millisecond', \
                                     in_flight_epoch = $3 \
                                 WHERE idempotency_key = $1",
                            )
                            .bind::<Text, _>(key)
                            .bind::<BigInt, _>(in_flight_ms)
                            .bind::<BigInt, _>(fence.epoch)
                            .execute(conn)
                            .await?;
                            DeliveryStart::Send {
                                attempt: row.attempts + 1,
                                url: row.url,
                                body: row.body,
                            }
                        }
                    })
                }
            })
            .await;
        match result {
            Ok(start) => Ok(start),
            Err(TxError::Abort(_)) => Ok(DeliveryStart::LeaseLost),
            Err(TxError::Store(e)) => Err(e),
        }
    }

    /// `claimed → delivered → acked` in one commit: the webhook answered 2xx,
    /// and nothing stands between the delivery and the ack. Each transition
    /// keeps its guard (state and epoch) and its history row, as
    /// `generated → persisted → claimed` do; the job is finished and unleased.
    pub async fn mark_delivered(
        self,
        fence: &Fence,
        key: &str,
        status: i32,
        faults: &Faults,
    ) -> Result<Checkpoint, StoreError> {
        if !before_commit(faults, &fence.job_id, &["delivered", "acked"]).await {
            return Ok(Checkpoint::Faulted);
        }
        // The guarded move (locking the job row first), the outbox row and
        // the history row: one statement, group-committed with other jobs'.
        let delivered = super::group_writes::Delivered {
            fence: fence.clone(),
            key: key.to_owned(),
            status,
        };
        (self.batches.delivered)
            .call_retrying(&self, "mark_delivered", delivered)
            .await
    }

    /// Records a failed POST and frees the row for the next attempt; with
    /// `kill`, dead-letters the job and closes the row instead, in the same
    /// transaction (so an at-most-once send that failed after it left can
    /// never be found "not in flight" and sent again). Fenced: `LeaseLost`
    /// writes nothing.
    pub async fn fail_delivery(
        self,
        fence: &Fence,
        key: &str,
        failed: &FailedSend,
        kill: Option<KillWith<'_>>,
    ) -> Result<Checkpoint, StoreError> {
        let error = serde_json::to_value(&failed.error).expect("envelope serialises");
        retrying!(self, "fail_delivery", async || {
            let mut conn = self.db().conn().await?;
            let result = conn
                .transaction::<_, TxError, _>(async |conn| {
                    guard(conn, fence).await?;
                    sql(
                        "UPDATE outbox SET last_error = $2, last_status = $3, in_flight_until = NULL, \
                             in_flight_epoch = NULL, updated_at = now(), \
                             status = coalesce($4::outbox_status, status) \
                         WHERE idempotency_key = $1 AND status = 'claimed'",
                    )
                    .bind::<Text, _>(key)
                    .bind::<Jsonb, _>(&error)
                    .bind::<Nullable<Integer>, _>(failed.status)
                    .bind::<Nullable<Text>, _>(kill.map(|k| k.outbox_status.as_sql()))
                    .execute(conn)
                    .await?;
                    if let Some(kill) = kill {
                        match Store::kill_in(conn, fence, kill.reason, &failed.error).await? {
                            Checkpoint::Moved => {}
                            other => return Err(TxError::Abort(other)),
                        }
                    }
                    Ok(())
                })
                .await;
            finish(result)
        })
        .await
    }

    /// `delivered → acked`: the job is finished and leaves the runnable set.
    /// One statement (the guarded move with its history row); the ack seam is
    /// [`FailPoint::Ack`], hit by the actor just before.
    pub async fn ack(self, fence: &Fence) -> Result<Checkpoint, StoreError> {
        let ack = super::group_writes::Ack {
            fence: fence.clone(),
        };
        (self.batches.ack).call_retrying(&self, "ack", ack).await
    }

    /// Dead-letters the job (and its outbox row, if `outbox_status` is given).
    pub async fn kill(
        self,
        fence: &Fence,
        reason: &str,
        error: &ErrorEnvelope,
        outbox: Option<(&str, OutboxStatus)>,
    ) -> Result<Checkpoint, StoreError> {
        retrying!(self, "kill", async || {
            let mut conn = self.db().conn().await?;
            let result = conn
                .transaction::<_, TxError, _>(async move |conn| {
                    {
                        guard(conn, fence).await?;
                        if let Some((key, status)) = outbox {
                            sql(
                                "UPDATE outbox SET status = $2::outbox_status, last_error = $3, in_flight_until = NULL, \
                                     updated_at = now() \
                                 WHERE idempotency_key = $1 AND status IN ('claimed', 'unknown')",
                            )
                            .bind::<Text, _>(key)
                            .bind::<Text, _>(status.as_sql())
                            .bind::<Jsonb, _>(serde_json::to_value(error).expect("envelope serialises"))
                            .execute(conn)
                            .await?;
                        }
                        match Store::kill_in(conn, fence, reason, error).await? {
                            Checkpoint::Moved => Ok(()),
                            other => Err(TxError::Abort(other)),
                        }
                    }
                })
                .await;
            finish(result)
        })
        .await
    }
}
