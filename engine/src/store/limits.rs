//! Provider limits shared through PostgreSQL: concurrency slots held per
//! model call, and the learned window of concurrent calls (AIMD). See
//! [`crate::limits`].

use diesel::sql_types::{BigInt, Double, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl};

use super::sql::sql;
use super::Store;
use crate::error::StoreError;

/// The channel a released slot is announced on.
pub const LIMITS_CHANNEL: &str = "onceflow_limits";

#[derive(QueryableByName)]
struct Window {
    #[diesel(sql_type = Nullable<Double>)]
    window: Option<f64>,
}

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

/// How a call that held a slot ended, for the learned window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallEnd {
    /// Answered: the window may grow ([`crate::limits::next_window`]).
    Answered,
    /// 429 (or Anthropic's 529): the window halves, at most once per guard interval.
    Throttled,
    /// Anything else: the window stays.
    Other,
}

impl Store {
    /// Takes a slot of `key` for `holder` (a model-call key) for `lease_ms`
    /// when fewer than `min(cap, learned window)` live slots are held, over
    /// every node; `false` when full. The key's row is locked first, so two
    /// admissions of one key never both see the last free slot.
    pub async fn take_slot(
        &self,
        key: &str,
        holder: &str,
        node: &str,
        lease_ms: i64,
        cap: Option<u32>,
    ) -> Result<bool, StoreError> {
        let mut conn = self.db().conn().await?;
        conn.transaction::<bool, StoreError, _>(async |conn| {
            let row: Window = sql("INSERT INTO provider_limits (limit_key) VALUES ($1) \
                 ON CONFLICT (limit_key) DO UPDATE SET limit_key = EXCLUDED.limit_key \
                 RETURNING \"window\"")
            .bind::<Text, _>(key)
            .get_result(conn)
            .await?;
            let allowed = match (cap.map(f64::from), row.window) {
                (Some(c), Some(w)) => c.min(w.floor()),
                (Some(c), None) => c,
                (None, Some(w)) => w.floor(),
                (None, None) => f64::INFINITY,
            };
            // A statement of its own: its snapshot sees every slot committed
            // before the lock above was granted.
            // (Lapsed slots of crashed nodes are cleared on the way.)
            let live: Count = sql("WITH lapsed AS (DELETE FROM provider_slots \
                     WHERE limit_key = $1 AND expires_at <= clock_timestamp()) \
                 SELECT count(*) AS n FROM provider_slots \
                 WHERE limit_key = $1 AND expires_at > clock_timestamp() AND holder <> $2")
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result(conn)
            .await?;
            if (live.n as f64) >= allowed {
                return Ok(false);
            }
            sql(
                "INSERT INTO provider_slots (limit_key, holder, node, expires_at) \
                 VALUES ($1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond') \
                 ON CONFLICT (limit_key, holder) DO UPDATE SET node = EXCLUDED.node, \
                     expires_at = EXCLUDED.expires_at",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .bind::<Text, _>(node)
            .bind::<BigInt, _>(lease_ms)
            .execute(conn)
            .await?;
            Ok(true)
        })
        .await
    }

    /// Releases `holder`'s slot of `key` (if it held one), moves the
    /// learned window by how the call ended ([`crate::limits::next_window`],
    /// with the database's clock, the key's row locked), and wakes every
    /// node's waiters.
    pub async fn end_call(
        &self,
        key: &str,
        holder: &str,
        end: CallEnd,
        cap: Option<u32>,
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
                "WITH released AS (DELETE FROM provider_slots WHERE limit_key = $1 AND holder = $2) \
                 SELECT count(*) AS n FROM provider_slots \
                 WHERE limit_key = $1 AND expires_at > clock_timestamp()",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result(conn)
            .await?;
            let next = crate::limits::next_window(
                crate::limits::WindowState {
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
                     throttled = throttled + CASE WHEN $4 THEN 1 ELSE 0 END \
                 WHERE limit_key = $1")
            .bind::<Text, _>(key)
            .bind::<Nullable<Double>, _>(next.window)
            .bind::<diesel::sql_types::Bool, _>(next.decreased)
            .bind::<diesel::sql_types::Bool, _>(end == CallEnd::Throttled)
            .execute(conn)
            .await?;
            sql("SELECT pg_notify($1, $2)")
                .bind::<Text, _>(LIMITS_CHANNEL)
                .bind::<Text, _>(key)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
    }

    /// Frees every slot `node` holds (it drains, or starts again under the
    /// same name: calls of its previous life hold none), and wakes waiters.
    pub async fn release_node_slots(&self, node: &str) -> Result<(), StoreError> {
        let mut conn = self.db().conn().await?;
        sql(
            "WITH gone AS (DELETE FROM provider_slots WHERE node = $1 RETURNING limit_key) \
             SELECT pg_notify($2, limit_key) FROM (SELECT DISTINCT limit_key FROM gone) k",
        )
        .bind::<Text, _>(node)
        .bind::<Text, _>(LIMITS_CHANNEL)
        .execute(&mut conn)
        .await?;
        Ok(())
    }

    /// Keeps `holder`'s model call marked in flight for `in_flight_ms` more,
    /// from now, when `epoch` still holds the mark (a call that waited for
    /// a provider limit sends only now).
    pub async fn extend_in_flight(
        &self,
        holder: &str,
        epoch: i64,
        in_flight_ms: i64,
    ) -> Result<(), StoreError> {
        let mut conn = self.db().conn().await?;
        sql("UPDATE model_calls SET in_flight_until = clock_timestamp() + $3 * interval '1 millisecond' \
             WHERE idempotency_key = $1 AND in_flight_epoch = $2 AND status <> 'completed'")
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(epoch)
        .bind::<BigInt, _>(in_flight_ms)
        .execute(&mut conn)
        .await?;
        Ok(())
    }

    /// The keys whose window is being learned (a 429 was seen).
    pub async fn learned_limit_keys(&self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.db().conn().await?;
        let rows: Vec<Key> =
            sql("SELECT limit_key FROM provider_limits WHERE \"window\" IS NOT NULL")
                .load(&mut conn)
                .await?;
        Ok(rows.into_iter().map(|r| r.limit_key).collect())
    }
}
