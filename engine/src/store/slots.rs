//! Provider limits shared through PostgreSQL: concurrency slots held per
//! model call, and the learned window of concurrent calls (AIMD). See
//! [`crate::rules::quota`].

use diesel::sql_types::{BigInt, Double, Integer, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use super::sql::sql;
use super::Limits;
use crate::error::StoreError;
use crate::rules::quota::CallEnd;

/// The channel a released slot is announced on.
pub const LIMITS_CHANNEL: &str = super::rows::Channel::Limits.name();

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct Key {
    #[diesel(sql_type = Text)]
    limit_key: String,
}

/// A model call asking its key's limit for admission.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    /// The limit key (`provider/model`).
    pub key: &'a str,
    /// The call (its model-call key and the attempt's epoch).
    pub holder: &'a str,
    /// The job the call belongs to.
    pub job_id: &'a str,
    /// The model call's idempotency key (its journal row).
    pub call_key: &'a str,
    /// The attempt's lease epoch: a slot is granted only while it still
    /// holds the job (no cancel, no takeover since the call was journaled).
    pub epoch: i64,
    /// The node running the call.
    pub node: &'a str,
    /// How long the slot is held if the node dies with it.
    pub lease_ms: i64,
    /// The configured limits of the key.
    pub spec: crate::rules::quota::LimitSpec,
    /// The call's estimated tokens ([`crate::rules::quota::estimate_tokens`]).
    pub tokens: f64,
    /// The job's priority: a waiter of higher priority goes first.
    pub priority: i32,
    /// Whether the call already waits (it has a waiter row to leave).
    pub queued: bool,
    /// Whether the call is its node's best waiter for the key, which keeps
    /// the node's other waiter rows from lapsing.
    pub refresh_node: bool,
    /// When the key has no free slot, park the job instead of queueing
    /// the call: the attempt lets the job go (no lease, no node capacity)
    /// with `waiting: {"kind": "provider", "key"}`, and a freed slot makes
    /// the first parked job due again ([`Admission::Parked`]).
    pub park: Option<&'a super::Fence>,
}

/// The answer to an [`Ask`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// The call holds a slot (and its rates' cost is taken); `saturation`
    /// is the share of the tightest limit now in use (0..=1).
    Admitted {
        /// The share of the tightest limit in use, this call included.
        saturation: f64,
    },
    /// The call waits, queued by priority; `retry_in` is when a rate will
    /// have refilled for it (`None`: when a slot is released).
    Wait {
        /// Seconds until the call's turn under a rate limit.
        retry_in: Option<f64>,
        /// When the call was first refused (µs since the epoch): its place
        /// among the calls of its priority.
        since_us: i64,
    },
    /// The attempt no longer holds the job (cancelled, or its lease taken
    /// over) or the call is no longer in flight under its epoch: nothing is
    /// granted and the call must not be sent.
    Fenced,
    /// No slot was free: the job is parked (see [`Ask::park`]), its call
    /// unsent and no longer marked in flight. It is due again when a slot
    /// of its key frees, or at `until` at the latest (the first of the
    /// key's slots to lapse, within [`PARKED_AT_MOST_MS`]).
    Parked {
        /// The latest it waits.
        until: chrono::DateTime<chrono::Utc>,
        /// Milliseconds until then, by the database's clock.
        left_ms: i64,
    },
}

/// The longest a parked job waits without a freed slot's wake-up; it also
/// asks again when the first of its key's slots lapses (a slot of a crashed
/// node wakes nobody).
pub const PARKED_AT_MOST_MS: i64 = 30_000;

impl Limits<'_> {
    /// Admits `ask` when its key has room on every node: fewer than
    /// `min(concurrency, learned window)` live slots held, counting the
    /// waiters queued ahead of it (higher priority, then longer waiting),
    /// and, with `rpm`/`tpm`, no waiter ahead and the buckets holding its
    /// cost ([`crate::rules::quota::Bucket`]). An admitted call holds a slot row
    /// for `lease_ms` and its cost is taken from the buckets; a refused one
    /// is queued (or keeps its place) in `provider_waiters`. The key's row
    /// is locked first, so two admissions never both see the last room.
    ///
    /// Four phases, one transaction: lock the key (`lock_key`), count the
    /// room (`count_room`), then either queue the call (`queue_waiter`) or
    /// grant it a slot under its fence (`grant`).
    pub async fn take_slot(self, ask: &Ask<'_>) -> Result<Admission, StoreError> {
        let spec = ask.spec;
        let mut conn = self.db().conn().await?;
        conn.transaction::<Admission, StoreError, _>(async |conn| {
            let key = lock_key(conn, ask.key).await?;
            let allowed = match (spec.concurrency.map(f64::from), key.window) {
                (Some(c), Some(w)) => c.min(w.floor()),
                (Some(c), None) => c,
                (None, Some(w)) => w.floor(),
                (None, None) => f64::INFINITY,
            };
            let room = count_room(conn, ask).await?;
            let now = |stored, per_minute: Option<u32>| {
                per_minute.map(|m| {
                    let b = crate::rules::quota::Bucket {
                        per_minute: f64::from(m),
                    };
                    (b, b.level(stored, key.since_refill))
                })
            };
            let costs: Costs = [
                (now(key.requests, spec.rpm), 1.0),
                (now(key.tokens, spec.tpm), ask.tokens),
            ];
            let slot_room = ((room.live + room.ahead) as f64) < allowed;
            let rated = costs.iter().any(|(b, _)| b.is_some());
            let rate_room = !rated
                || (room.ahead == 0
                    && costs
                        .iter()
                        .all(|(b, cost)| b.is_none_or(|(b, level)| level >= b.need(*cost))));
            match ask.park {
                _ if slot_room && rate_room => grant(conn, ask, &room, allowed, costs).await,
                Some(fence) if !slot_room => park(conn, ask, fence).await,
                _ => queue_waiter(conn, ask, &room, costs, slot_room).await,
            }
        })
        .await
    }

    /// Releases `holder`'s slot of `key` (if it held one), moves the
    /// learned window by how the call ended ([`crate::rules::quota::next_window`],
    /// with the database's clock, the key's row locked), and wakes every
    /// node's waiters.
    ///
    /// `tokens_over` corrects the `tpm` bucket by what the call cost beyond
    /// its estimate (negative: a refund; the usage the answer reported, or
    /// the whole estimate back when the provider refused the call).
    pub async fn end_call(
        self,
        key: &str,
        holder: &str,
        end: CallEnd,
        cap: Option<u32>,
        tokens_over: f64,
    ) -> Result<(), StoreError> {
        #[derive(QueryableByName)]
        struct State {
            #[diesel(sql_type = Nullable<Double>)]
            window: Option<f64>,
            /// Seconds since the last decrease (NULL: never).
            #[diesel(sql_type = Nullable<Double>)]
            since_decrease: Option<f64>,
        }
        let mut conn = self.db().conn().await?;
        conn.transaction::<(), StoreError, _>(async |conn| {
            // The key's row first, as `take_slot` locks it: one lock order.
            let state: State = sql(
                "INSERT INTO provider_limits (limit_key) VALUES ($1) \
                 ON CONFLICT (limit_key) DO UPDATE SET limit_key = EXCLUDED.limit_key \
                 RETURNING \"window\", \
                     extract(epoch FROM clock_timestamp() - decreased_at)::float8 AS since_decrease",
            )
            .bind::<Text, _>(key)
            .get_result(conn)
            .await?;
            let live: Count = sql(
                "WITH released AS (DELETE FROM provider_slots WHERE limit_key = $1 AND holder = $2), \
                 unqueued AS (DELETE FROM provider_waiters WHERE limit_key = $1 AND holder = $2) \
                 SELECT count(*) AS n FROM provider_slots \
                 WHERE limit_key = $1 AND expires_at > clock_timestamp()",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result(conn)
            .await?;
            let next = crate::rules::quota::next_window(
                crate::rules::quota::WindowState {
                    window: state.window,
                    since_decrease: state.since_decrease,
                    // This call and the others in flight filled the window.
                    saturated: state.window.is_some_and(|w| (live.n + 1) as f64 >= w.floor()),
                },
                end,
                cap,
            );
            sql("UPDATE provider_limits SET \"window\" = $2, \
                     decreased_at = CASE WHEN $3 THEN clock_timestamp() ELSE decreased_at END, \
                     throttled = throttled + CASE WHEN $4 THEN 1 ELSE 0 END, \
                     tokens = tokens - $5 \
                 WHERE limit_key = $1")
            .bind::<Text, _>(key)
            .bind::<Nullable<Double>, _>(next.window)
            .bind::<diesel::sql_types::Bool, _>(next.decreased)
            .bind::<diesel::sql_types::Bool, _>(end == CallEnd::Throttled)
            .bind::<Double, _>(tokens_over)
            .execute(conn)
            .await?;
            sql("SELECT pg_notify($1, $2)")
                .bind::<Text, _>(LIMITS_CHANNEL)
                .bind::<Text, _>(key)
                .execute(conn)
                .await?;
            wake_parked(conn, key, 1).await?;
            Ok(())
        })
        .await
    }

    /// Frees every slot `node` holds and its queued waiters (it drains, or starts again under the
    /// same name: calls of its previous life hold none), and wakes waiters.
    pub async fn release_node_slots(self, node: &str) -> Result<(), StoreError> {
        #[derive(QueryableByName)]
        struct Freed {
            #[diesel(sql_type = Text)]
            limit_key: String,
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let mut conn = self.db().conn().await?;
        let freed: Vec<Freed> = sql(
            "WITH gone AS (DELETE FROM provider_slots WHERE node = $1 RETURNING limit_key), \
             unqueued AS (DELETE FROM provider_waiters WHERE node = $1) \
             SELECT limit_key, count(*) AS n, pg_notify($2, limit_key) IS NULL AS told \
             FROM gone GROUP BY limit_key",
        )
        .bind::<Text, _>(node)
        .bind::<Text, _>(LIMITS_CHANNEL)
        .load(&mut conn)
        .await?;
        // As many parked jobs as slots freed are due again.
        for f in freed {
            wake_parked(&mut conn, &f.limit_key, f.n).await?;
        }
        Ok(())
    }

    /// Keeps model call `call_key` of `epoch` marked in flight, and its
    /// provider slot `(limit_key, holder)` held, for `ms` more from now: a
    /// streamed answer that outlasts the request timeout.
    pub async fn renew_call(
        self,
        call_key: &str,
        epoch: i64,
        slot: Option<(&str, &str)>,
        ms: i64,
    ) -> Result<(), StoreError> {
        let mut conn = self.db().conn().await?;
        sql("WITH mark AS ( \
                 UPDATE model_calls SET in_flight_until = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE idempotency_key = $1 AND in_flight_epoch = $2 AND status <> 'completed' RETURNING 1), \
             hold AS (UPDATE budget_holds SET expires_at = clock_timestamp() + $3 * interval '1 millisecond' \
                 WHERE call_key = $1 AND EXISTS (SELECT 1 FROM mark)) \
             UPDATE provider_slots SET expires_at = clock_timestamp() + $3 * interval '1 millisecond' \
             WHERE limit_key = $4 AND holder = $5 AND (SELECT count(*) FROM mark) >= 0")
        .bind::<Text, _>(call_key)
        .bind::<BigInt, _>(epoch)
        .bind::<BigInt, _>(ms)
        .bind::<Nullable<Text>, _>(slot.map(|s| s.0))
        .bind::<Nullable<Text>, _>(slot.map(|s| s.1))
        .execute(&mut conn)
        .await?;
        Ok(())
    }

    /// The keys whose window is being learned (a 429 was seen).
    pub async fn learned_keys(self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.db().conn().await?;
        let rows: Vec<Key> =
            sql("SELECT limit_key FROM provider_limits WHERE \"window\" IS NOT NULL")
                .load(&mut conn)
                .await?;
        Ok(rows.into_iter().map(|r| r.limit_key).collect())
    }
}

/// A key's limit row as locked for an admission.
#[derive(QueryableByName)]
struct KeyRow {
    #[diesel(sql_type = Nullable<Double>)]
    window: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    requests: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    tokens: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    since_refill: Option<f64>,
}

/// What an admission sees of its key: slots held by others, waiters ahead
/// of it, waiters in all.
#[derive(QueryableByName)]
struct Room {
    #[diesel(sql_type = BigInt)]
    live: i64,
    #[diesel(sql_type = BigInt)]
    ahead: i64,
    #[diesel(sql_type = BigInt)]
    waiting: i64,
    /// When this call was first refused (now, if never), in µs.
    #[diesel(sql_type = BigInt)]
    since_us: i64,
}

/// The call's cost under each rate (requests, tokens): the bucket with its
/// level now, if the key has that rate, and what the call takes from it.
type Costs = [(Option<(crate::rules::quota::Bucket, f64)>, f64); 2];

/// Locks key `key`'s limit row (made on first use) and reads it.
async fn lock_key(conn: &mut AsyncPgConnection, key: &str) -> Result<KeyRow, StoreError> {
    Ok(sql("INSERT INTO provider_limits (limit_key) VALUES ($1) \
         ON CONFLICT (limit_key) DO UPDATE SET limit_key = EXCLUDED.limit_key \
         RETURNING \"window\", requests, tokens, \
             extract(epoch FROM clock_timestamp() - refilled_at)::float8 AS since_refill")
    .bind::<Text, _>(key)
    .get_result(conn)
    .await?)
}

/// Counts the key's room, in a statement of its own: its snapshot sees
/// every slot and waiter committed before the key's lock was granted.
/// (Lapsed slots and waiters of crashed nodes are cleared on the way.) A
/// parked job counts among the waiters only once a freed slot woke it,
/// and for 10 s: a woken job no node can take (every node full, or its
/// concurrency key's slots held) never holds the key's other calls back.
/// A job parked before keeps its place (`queued_at`) when it asks again.
async fn count_room(conn: &mut AsyncPgConnection, ask: &Ask<'_>) -> Result<Room, StoreError> {
    Ok(sql(
        "WITH lapsed AS (DELETE FROM provider_slots \
             WHERE limit_key = $1 AND expires_at <= clock_timestamp()), \
         gone AS (DELETE FROM provider_waiters \
             WHERE limit_key = $1 AND expires_at <= clock_timestamp()), \
         me AS (SELECT coalesce((SELECT since FROM provider_waiters \
             WHERE limit_key = $1 AND holder = $2), \
             (SELECT (waiting->>'queued_at')::timestamptz FROM jobs WHERE id = $4 \
                 AND waiting->>'kind' = 'provider' AND waiting->>'key' = $1), \
             clock_timestamp()) AS since), \
         parked AS (SELECT p.priority, (p.waiting->>'queued_at')::timestamptz AS since, p.id \
             FROM jobs p WHERE p.waiting->>'kind' = 'provider' AND p.waiting->>'key' = $1 \
               AND p.finished_at IS NULL AND p.lease_owner IS NULL AND p.id <> $4 \
               AND p.run_at <= now() AND p.run_at > now() - interval '10 seconds') \
         SELECT (SELECT count(*) FROM provider_slots \
                 WHERE limit_key = $1 AND expires_at > clock_timestamp() AND holder <> $2) AS live, \
             (SELECT count(*) FROM provider_waiters w, me \
                 WHERE w.limit_key = $1 AND w.expires_at > clock_timestamp() AND w.holder <> $2 \
                   AND (w.priority > $3 OR (w.priority = $3 \
                        AND (w.since, w.holder) < (me.since, $2)))) \
             + (SELECT count(*) FROM parked p, me \
                 WHERE p.priority > $3 OR (p.priority = $3 AND (p.since, p.id) < (me.since, $4))) AS ahead, \
             (SELECT count(*) FROM provider_waiters \
                 WHERE limit_key = $1 AND expires_at > clock_timestamp() AND holder <> $2) \
             + (SELECT count(*) FROM parked) AS waiting, \
             (SELECT (extract(epoch FROM since) * 1000000)::int8 FROM me) AS since_us",
    )
    .bind::<Text, _>(ask.key)
    .bind::<Text, _>(ask.holder)
    .bind::<Integer, _>(ask.priority)
    .bind::<Text, _>(ask.job_id)
    .get_result(conn)
    .await?)
}

/// Parks the job of `ask` (see [`Ask::park`]), in the admission's
/// transaction, the key's row locked: a slot freed after this commits
/// finds the job parked and wakes it; one freed before was counted as room.
/// The call was journaled in flight but never sent: its mark is cleared
/// (and its send uncounted), so the job's next attempt sends it at once,
/// under the same key. A job parked again keeps its place (`queued_at`).
async fn park(
    conn: &mut AsyncPgConnection,
    ask: &Ask<'_>,
    fence: &super::Fence,
) -> Result<Admission, StoreError> {
    #[derive(QueryableByName)]
    struct Parked {
        #[diesel(sql_type = diesel::sql_types::Timestamptz)]
        until: chrono::DateTime<chrono::Utc>,
        #[diesel(sql_type = BigInt)]
        left_ms: i64,
    }
    sql("DELETE FROM provider_waiters WHERE limit_key = $1 AND holder = $2")
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .execute(conn)
        .await?;
    let parked: Vec<Parked> = sql(
        "WITH unsent AS ( \
             UPDATE model_calls SET in_flight_until = NULL, in_flight_epoch = NULL, \
                 attempts = greatest(attempts - 1, 0), updated_at = now() \
             WHERE idempotency_key = $3 AND in_flight_epoch = $2 AND status <> 'completed'), \
         unheld AS (DELETE FROM budget_holds WHERE call_key = $3) \
         UPDATE jobs SET waiting = jsonb_build_object('kind', 'provider', 'key', $4::text, \
                 'queued_at', CASE WHEN waiting->>'kind' = 'provider' AND waiting->>'key' = $4 \
                     THEN waiting->>'queued_at' \
                     ELSE to_char(clock_timestamp() AT TIME ZONE 'UTC', \
                         'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') END), \
             run_at = least(now() + $5 * interval '1 millisecond', \
                 (SELECT min(expires_at) FROM provider_slots \
                  WHERE limit_key = $4 AND expires_at > clock_timestamp())), \
             lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL, updated_at = now() \
         WHERE id = $1 AND lease_epoch = $2 AND finished_at IS NULL \
         RETURNING run_at AS until, \
             greatest(0, ceil(extract(epoch FROM run_at - clock_timestamp()) * 1000))::bigint AS left_ms",
    )
    .bind::<Text, _>(&fence.job_id)
    .bind::<BigInt, _>(fence.epoch)
    .bind::<Text, _>(ask.call_key)
    .bind::<Text, _>(ask.key)
    .bind::<BigInt, _>(PARKED_AT_MOST_MS)
    .load(conn)
    .await?;
    Ok(match parked.into_iter().next() {
        Some(p) => Admission::Parked {
            until: p.until,
            left_ms: p.left_ms,
        },
        None => Admission::Fenced,
    })
}

/// Makes the first `n` jobs parked on `key` due now (by priority, then
/// their place), announcing them; jobs woken already and not yet taken
/// are not woken twice.
async fn wake_parked(conn: &mut AsyncPgConnection, key: &str, n: i64) -> Result<(), StoreError> {
    sql("WITH next AS ( \
             SELECT id FROM jobs \
             WHERE waiting->>'kind' = 'provider' AND waiting->>'key' = $1 \
               AND finished_at IS NULL AND lease_owner IS NULL AND run_at > now() \
             ORDER BY priority DESC, waiting->>'queued_at', id LIMIT $2 \
             FOR UPDATE SKIP LOCKED), \
         woken AS (UPDATE jobs j SET run_at = now(), updated_at = now() \
             FROM next WHERE j.id = next.id RETURNING j.id) \
         SELECT pg_notify($3, 'provider') WHERE EXISTS (SELECT 1 FROM woken)")
    .bind::<Text, _>(key)
    .bind::<BigInt, _>(n)
    .bind::<Text, _>(super::rows::NEW_JOB_CHANNEL)
    .execute(conn)
    .await?;
    Ok(())
}

/// Queues a refused call (or keeps its place) and says when to ask again.
async fn queue_waiter(
    conn: &mut AsyncPgConnection,
    ask: &Ask<'_>,
    room: &Room,
    costs: Costs,
    slot_room: bool,
) -> Result<Admission, StoreError> {
    sql(
        "INSERT INTO provider_waiters (limit_key, holder, node, priority, since, expires_at) \
         VALUES ($1, $2, $3, $4, 'epoch'::timestamptz + $5 * interval '1 microsecond', \
             clock_timestamp() + interval '15 seconds') \
         ON CONFLICT (limit_key, holder) DO UPDATE SET node = EXCLUDED.node, \
             expires_at = EXCLUDED.expires_at",
    )
    .bind::<Text, _>(ask.key)
    .bind::<Text, _>(ask.holder)
    .bind::<Text, _>(ask.node)
    .bind::<Integer, _>(ask.priority)
    .bind::<BigInt, _>(room.since_us)
    .execute(conn)
    .await?;
    if ask.refresh_node {
        // The node's best waiter keeps all its waiters' rows fresh.
        sql(
            "UPDATE provider_waiters SET expires_at = clock_timestamp() + interval '15 seconds' \
             WHERE limit_key = $1 AND node = $2 AND holder <> $3",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.node)
        .bind::<Text, _>(ask.holder)
        .execute(conn)
        .await?;
    }
    // Under a rate, the waiters ahead go first, one cost each: this call's
    // turn comes when the bucket holds theirs too.
    let retry_in = costs
        .iter()
        .filter_map(|(b, cost)| {
            b.map(|(b, level)| b.wait_secs(level, b.need(*cost) + room.ahead as f64 * cost))
        })
        .reduce(f64::max)
        // Calls ahead go first: never ask again sooner than they can (a
        // stalled one would make it a busy loop).
        .map(|secs| if room.ahead > 0 { secs.max(0.05) } else { secs })
        .filter(|_| slot_room);
    Ok(Admission::Wait {
        retry_in,
        since_us: room.since_us,
    })
}

/// Grants the call a slot, if its attempt still holds the job: takes its
/// cost from the buckets, wakes the next waiter when room is left, and
/// reports the key's saturation.
async fn grant(
    conn: &mut AsyncPgConnection,
    ask: &Ask<'_>,
    room: &Room,
    allowed: f64,
    costs: Costs,
) -> Result<Admission, StoreError> {
    // The fence, checked as the slot is granted: the call was journaled
    // before it waited, and a cancel or a takeover may have come
    // meanwhile. Its in-flight mark counts from now, the send (a
    // concurrent attempt waits on it).
    let held = sql(
        "UPDATE model_calls m SET in_flight_until = clock_timestamp() + $4 * interval '1 millisecond' \
         FROM jobs j \
         WHERE m.idempotency_key = $1 AND m.in_flight_epoch = $3 AND m.status <> 'completed' \
           AND j.id = $2 AND m.job_id = j.id AND j.lease_epoch = $3 AND j.finished_at IS NULL",
    )
    .bind::<Text, _>(ask.call_key)
    .bind::<Text, _>(ask.job_id)
    .bind::<BigInt, _>(ask.epoch)
    .bind::<BigInt, _>(ask.lease_ms)
    .execute(conn)
    .await?;
    // The call's budget hold, if it has one, lasts as long as its send.
    sql(
        "UPDATE budget_holds SET expires_at = clock_timestamp() + $2 * interval '1 millisecond' \
         WHERE call_key = $1",
    )
    .bind::<Text, _>(ask.call_key)
    .bind::<BigInt, _>(ask.lease_ms)
    .execute(conn)
    .await?;
    if held == 0 || ask.queued {
        sql("DELETE FROM provider_waiters WHERE limit_key = $1 AND holder = $2")
            .bind::<Text, _>(ask.key)
            .bind::<Text, _>(ask.holder)
            .execute(conn)
            .await?;
    }
    if held == 0 {
        return Ok(Admission::Fenced);
    }
    sql(
        "INSERT INTO provider_slots (limit_key, holder, node, expires_at) \
         VALUES ($1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond') \
         ON CONFLICT (limit_key, holder) DO UPDATE SET node = EXCLUDED.node, \
             expires_at = EXCLUDED.expires_at",
    )
    .bind::<Text, _>(ask.key)
    .bind::<Text, _>(ask.holder)
    .bind::<Text, _>(ask.node)
    .bind::<BigInt, _>(ask.lease_ms)
    .execute(conn)
    .await?;
    let after = costs.map(|(b, cost)| b.map(|(b, level)| (b, level - cost)));
    if costs.iter().any(|(b, _)| b.is_some()) {
        sql("UPDATE provider_limits SET requests = $2, tokens = $3, \
                 refilled_at = clock_timestamp() WHERE limit_key = $1")
        .bind::<Text, _>(ask.key)
        .bind::<Nullable<Double>, _>(after[0].map(|(_, l)| l))
        .bind::<Nullable<Double>, _>(after[1].map(|(_, l)| l))
        .execute(conn)
        .await?;
    }
    // Room left and calls waiting: the next one is woken, on every node.
    let room_left = ((room.live + 1 + room.ahead) as f64) < allowed
        && after
            .iter()
            .zip(costs.iter())
            .all(|(a, (_, cost))| a.is_none_or(|(b, level)| level >= b.need(*cost)));
    if room_left && room.waiting > 0 {
        sql("SELECT pg_notify($1, $2)")
            .bind::<Text, _>(LIMITS_CHANNEL)
            .bind::<Text, _>(ask.key)
            .execute(conn)
            .await?;
        wake_parked(conn, ask.key, 1).await?;
    }
    // A job parked before holds its place no more.
    sql("UPDATE jobs SET waiting = NULL WHERE id = $1 AND waiting->>'kind' = 'provider'")
        .bind::<Text, _>(ask.job_id)
        .execute(conn)
        .await?;
    let mut saturation: f64 = if allowed.is_finite() {
        (room.live + 1) as f64 / allowed
    } else {
        0.0
    };
    for (b, level) in after.into_iter().flatten() {
        saturation = saturation.max(1.0 - level / b.capacity());
    }
    Ok(Admission::Admitted {
        saturation: saturation.clamp(0.0, 1.0),
    })
}
