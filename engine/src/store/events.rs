//! Failure events (`job.dead`, `job.cancelled`): outbox rows of jobs that
//! are already finished, so no job actor sends them. Any node's supervisor
//! claims the due ones (`FOR UPDATE SKIP LOCKED`), sends them under their
//! stable key, and records the outcome; a failed send is retried with
//! backoff until the webhook budget is spent.

use diesel::sql_types::{BigInt, Integer, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use serde_json::Value;

use super::sql::sql;
use super::Events;
use crate::error::{ErrorEnvelope, StoreError};

/// Announces a failure event written by SQL (a death, an approval's wait):
/// every node's supervisor sweeps for due events at once, so none waits on
/// a timer. The payload is the job's id.
pub const EVENTS_CHANNEL: &str = super::rows::Channel::Events.name();

/// Whether outbox row `o`'s moment has passed, so it is closed, never
/// sent: a `job.dead` whose job is no longer dead (redriven), or a
/// `job.waiting` whose wait is over (decided, timed out) or whose job has
/// finished. A `job.cancelled` stays true once true.
macro_rules! moot {
    () => {
        "((o.event = 'job.dead' AND NOT EXISTS ( \
               SELECT 1 FROM jobs j WHERE j.id = o.job_id AND j.state = 'dead')) \
          OR (o.event LIKE 'job.waiting:%' AND NOT EXISTS ( \
               SELECT 1 FROM jobs j JOIN waits w ON w.job_id = j.id \
               WHERE j.id = o.job_id AND j.finished_at IS NULL AND w.outcome IS NULL \
                 AND w.name = o.body->'data'->'waiting'->>'name' \
                 AND w.until = (o.body->'data'->'waiting'->>'until')::timestamptz)))"
    };
}

/// The reason recorded on an event closed unsent because its moment passed.
pub const MOOT_CODE: &str = "event_moot";

/// An event send this node claimed.
#[derive(Debug, Clone, QueryableByName)]
pub struct EventSend {
    /// The finished job the event is about.
    #[diesel(sql_type = Text)]
    pub job_id: String,
    /// The event's stable key (`job:{id}:dead`, `job:{id}:cancelled`): `Idempotency-Key` and `webhook-id`.
    #[diesel(sql_type = Text)]
    pub idempotency_key: String,
    /// The job's `webhook_url`.
    #[diesel(sql_type = Text)]
    pub url: String,
    /// The event payload, as sent.
    #[diesel(sql_type = Jsonb)]
    pub body: Value,
    /// Sends of this event so far, this one included.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The API token that submitted the job (the event's signing secret).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub owner_token: Option<i64>,
}

impl Events<'_> {
    /// Claims up to `limit` due event sends, marking each in flight for
    /// `in_flight_ms` (a node that dies mid-send leaves the mark to expire;
    /// the next claim sends again under the same key: at least once).
    pub async fn claim(self, limit: i64, in_flight_ms: i64) -> Result<Vec<EventSend>, StoreError> {
        let mut conn = self.db().conn().await?;
        // Those whose moment has passed are closed first, with the reason.
        let moot = serde_json::to_value(ErrorEnvelope {
            code: MOOT_CODE.into(),
            message: "not sent: its moment passed (the job was redriven, or the wait it announced is over)".into(),
            retryable: false,
        })
        .expect("envelope serialises");
        let closed = sql(concat!(
            "UPDATE outbox o SET status = 'dead', in_flight_until = NULL, run_at = 'infinity', \
                 updated_at = now(), last_error = $1 \
             WHERE o.status = 'claimed' AND o.event <> 'job.completed' AND o.run_at <= now() \
               AND (o.in_flight_until IS NULL OR o.in_flight_until < clock_timestamp()) AND ",
            moot!()
        ))
        .bind::<Jsonb, _>(&moot)
        .execute(&mut conn)
        .await?;
        if closed > 0 {
            tracing::info!(closed, "events whose moment passed closed unsent");
        }
        Ok(sql(
            "UPDATE outbox o SET attempts = o.attempts + 1, updated_at = now(), \
                 in_flight_until = clock_timestamp() + $2 * interval '1 millisecond' \
             WHERE o.id IN ( \
                 SELECT id FROM outbox \
                 WHERE status = 'claimed' AND event <> 'job.completed' AND run_at <= now() \
                   AND (in_flight_until IS NULL OR in_flight_until < clock_timestamp()) \
                 ORDER BY run_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
             RETURNING o.job_id, o.idempotency_key, o.url, o.body, o.attempts, \
                 (SELECT owner_token FROM jobs WHERE id = o.job_id) AS owner_token",
        )
        .bind::<BigInt, _>(limit)
        .bind::<BigInt, _>(in_flight_ms)
        .load(&mut conn)
        .await?)
    }

    /// Marks claimed `event` in flight for `in_flight_ms` from now, just
    /// before its own send, when this node's claim still holds it (no other
    /// node claimed it since: its `attempts` is the one this claim set). A
    /// batch's single claim mark would lapse while earlier events of the
    /// batch are sent to a slow consumer; this one covers each send. False:
    /// another node has it, or its moment passed since the claim (the next
    /// claim closes it): do not send.
    pub async fn mark_sending(
        self,
        event: &EventSend,
        in_flight_ms: i64,
    ) -> Result<bool, StoreError> {
        retrying!(self, "mark_event_sending", async || {
            let mut conn = self.db().conn().await?;
            let n = sql(concat!(
                "UPDATE outbox o SET in_flight_until = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE o.idempotency_key = $1 AND o.attempts = $2 AND o.status = 'claimed' AND NOT ",
                moot!()
            ))
            .bind::<Text, _>(&event.idempotency_key)
            .bind::<Integer, _>(event.attempts)
            .bind::<BigInt, _>(in_flight_ms)
            .execute(&mut conn)
            .await?;
            Ok(n == 1)
        })
        .await
    }

    /// Records the outcome of send number `attempts` of an event, while no
    /// later claim has taken it (a late outcome from a node whose mark
    /// lapsed never clears the mark of the node sending it now): delivered (`status` set), retried
    /// `retry_in` from now by the database's clock, or closed `dead`
    /// (`retry_in` none). A closed event's
    /// `run_at` becomes `infinity`: the index of due events keeps closed ones
    /// until the purge, and the claim, which walks it in `run_at` order up to
    /// now, then never reaches them.
    pub async fn outcome(
        self,
        key: &str,
        attempts: i32,
        status: Option<i32>,
        error: Option<&ErrorEnvelope>,
        retry_in: Option<std::time::Duration>,
    ) -> Result<(), StoreError> {
        let retry_ms = retry_in.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2));
        let error = error.map(|e| serde_json::to_value(e).expect("envelope serialises"));
        retrying!(self, "event_outcome", async || {
            let mut conn = self.db().conn().await?;
            sql(
                "UPDATE outbox SET in_flight_until = NULL, updated_at = now(), last_status = $2, \
                     last_error = $3, \
                     status = CASE WHEN $3 IS NULL THEN 'delivered'::outbox_status \
                                   WHEN $4 IS NULL THEN 'dead'::outbox_status ELSE status END, \
                     delivered_at = CASE WHEN $3 IS NULL THEN now() ELSE delivered_at END, \
                     run_at = CASE WHEN $3 IS NOT NULL AND $4 IS NOT NULL \
                                   THEN clock_timestamp() + $4 * interval '1 millisecond' \
                                   ELSE 'infinity'::timestamptz END \
                 WHERE idempotency_key = $1 AND status = 'claimed' AND attempts = $5",
            )
            .bind::<Text, _>(key)
            .bind::<Nullable<Integer>, _>(status)
            .bind::<Nullable<Jsonb>, _>(&error)
            .bind::<Nullable<BigInt>, _>(retry_ms)
            .bind::<Integer, _>(attempts)
            .execute(&mut conn)
            .await?;
            Ok(())
        })
        .await
    }

    /// How long until the soonest event send is due by the database's
    /// clock — a retry's backoff, or another node's send in flight whose
    /// mark lapses if that node died — or `None` when none is pending.
    /// Zero when one is due now. Read through `outbox_events_due`: closed
    /// events sit at `run_at = infinity`, outside the range read.
    pub async fn next_in(self) -> Result<Option<std::time::Duration>, StoreError> {
        #[derive(QueryableByName)]
        struct Next {
            #[diesel(sql_type = Nullable<BigInt>)]
            ms: Option<i64>,
        }
        let mut conn = self.db().conn().await?;
        let next: Next = sql("SELECT ceil(extract(epoch FROM \
                 min(greatest(run_at, coalesce(in_flight_until, run_at))) - clock_timestamp()) \
                 * 1000)::bigint AS ms \
             FROM outbox \
             WHERE status = 'claimed' AND event <> 'job.completed' AND run_at < 'infinity'")
        .get_result(&mut conn)
        .await?;
        Ok(next
            .ms
            .map(|ms| std::time::Duration::from_millis(ms.max(0) as u64)))
    }
}
