//! Model-token budgets: a token's budget per UTC day, what its tenant spent
//! today (`token_spend`, added to when a model answer is recorded), the
//! holds of the calls in flight (`budget_holds`: a budget is a reservation),
//! and the wait of a job whose call does not fit.

use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;

use super::lease::Fence;
use super::sql::sql;
use super::Waits;
use crate::error::StoreError;

/// What a tenant with a budget may do before its next model call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Budget {
    /// Under its budget (the call now holds its share), or the call is
    /// answered already (a replay costs nothing), or no budget is set.
    Open {
        /// Whether the call holds a share of the budget: its answer settles
        /// it, and wakes the jobs that other holds kept waiting.
        held: bool,
    },
    /// Spent, or held by the calls in flight: the job was released (no
    /// lease) and waits until `until`.
    Wait {
        /// The next UTC day (spread over its first 30 s, so the held jobs
        /// do not all start at once), or, when only other calls' holds
        /// keep it, the soonest of them to lapse (an answer that settles
        /// one wakes it sooner).
        until: chrono::DateTime<chrono::Utc>,
        /// Milliseconds until then, by the database's clock.
        left_ms: i64,
        /// Held by the calls in flight, not by what was spent.
        reserved: bool,
    },
    /// The attempt no longer holds the job: nothing was held or released.
    Fenced,
    /// Spent, and the token says a job then dies (`budget_exhausted`).
    Die {
        /// The budget.
        budget: i64,
        /// What was spent today.
        spent: i64,
    },
}

/// What a model call asks of its tenant's budget before it is sent.
#[derive(Debug, Clone)]
pub struct Hold<'a> {
    /// The call's idempotency key: its hold, replaced when it is sent again.
    pub key: &'a str,
    /// What it may use: its input's estimate plus the output it allows.
    pub tokens: i64,
    /// How long the hold lasts if no answer settles it (the call's
    /// in-flight bound).
    pub for_ms: i64,
}

#[derive(QueryableByName)]
struct BudgetRow {
    #[diesel(sql_type = BigInt)]
    budget: i64,
    #[diesel(sql_type = Text)]
    action: String,
    #[diesel(sql_type = Bool)]
    answered: bool,
}

#[derive(QueryableByName)]
struct DayRow {
    #[diesel(sql_type = BigInt)]
    spent: i64,
    #[diesel(sql_type = BigInt)]
    held: i64,
    #[diesel(sql_type = Timestamptz)]
    midnight: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = BigInt)]
    midnight_ms: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    lapse: Option<chrono::DateTime<chrono::Utc>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    lapse_ms: Option<i64>,
}

/// A tenant's spend today, as `GET /v1/stats` shows it.
#[derive(Debug, Clone, QueryableByName, serde::Serialize, utoipa::ToSchema)]
pub struct Spend {
    /// The token's name.
    #[diesel(sql_type = Text)]
    pub token: String,
    /// Model tokens (input + output) its jobs' answers used today (UTC).
    #[diesel(sql_type = BigInt)]
    pub spent_today: i64,
    /// Its budget per UTC day.
    #[diesel(sql_type = BigInt)]
    pub daily_budget: i64,
}

impl Waits<'_> {
    /// Whether a job of token `owner` may send model call `hold.key` now,
    /// and if so its hold on the budget. Only a token that is not admin
    /// and has a budget has one; a call already answered is a replay,
    /// which spends nothing.
    ///
    /// The day's spend row is locked first, in the same transaction, so
    /// the next statement reads every hold another node committed before
    /// it: the calls in flight together never hold more than the budget
    /// left (one call may hold more than a whole budget only when nothing
    /// is spent or held, or it would never run). A day's spend passes its
    /// budget only by what calls use beyond their holds: their input's
    /// estimate's error, and, for a request that does not bound its output
    /// (`max_tokens`, `max_completion_tokens`), what it writes beyond
    /// [`DEFAULT_OUTPUT_HOLD`] — never by the number of calls at once.
    ///
    /// A job that waits is released under `fence` in the same transaction
    /// (no lease; `Budget::Wait`), while the day's row is locked: an answer
    /// that settles a hold meanwhile commits after it, and so finds the job
    /// waiting when it wakes the token's waiters. `Budget::Fenced` when the
    /// attempt no longer holds the job.
    pub async fn budget(
        self,
        owner: Option<i64>,
        hold: &Hold<'_>,
        fence: &Fence,
    ) -> Result<Budget, StoreError> {
        let Some(owner) = owner else {
            return Ok(Budget::Open { held: false });
        };
        retrying!(self, "budget", async || {
            let mut conn = self.db().conn().await?;
            use diesel_async::AsyncConnection as _;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                let token: Vec<BudgetRow> = sql(
                    "SELECT t.daily_token_budget AS budget, t.budget_exhausted AS action, \
                         EXISTS (SELECT 1 FROM model_calls m WHERE m.idempotency_key = $2 \
                             AND m.status = 'completed') AS answered \
                     FROM api_tokens t \
                     WHERE t.id = $1 AND NOT t.admin AND t.daily_token_budget IS NOT NULL",
                )
                .bind::<BigInt, _>(owner)
                .bind::<Text, _>(hold.key)
                .load(conn)
                .await?;
                let Some(token) = token.into_iter().next().filter(|t| !t.answered) else {
                    return Ok(Budget::Open { held: false });
                };
                sql("INSERT INTO token_spend (tenant, day, tokens) \
                     VALUES ($1, (now() AT TIME ZONE 'UTC')::date, 0) ON CONFLICT DO NOTHING")
                .bind::<BigInt, _>(owner)
                .execute(conn)
                .await?;
                sql("SELECT 1 FROM token_spend WHERE tenant = $1 \
                         AND day = (now() AT TIME ZONE 'UTC')::date FOR UPDATE")
                .bind::<BigInt, _>(owner)
                .execute(conn)
                .await?;
                // A new statement: a new snapshot, taken under the lock.
                let day: DayRow = sql(
                    "WITH next AS (SELECT (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day') \
                             AT TIME ZONE 'UTC' + random() * interval '30 seconds' AS at), \
                         holds AS (SELECT h.tokens, h.expires_at FROM budget_holds h \
                             WHERE h.tenant = $1 AND h.day = (now() AT TIME ZONE 'UTC')::date \
                               AND h.expires_at > clock_timestamp() AND h.call_key <> $2) \
                     SELECT s.tokens AS spent, \
                         coalesce((SELECT sum(tokens) FROM holds), 0)::bigint AS held, \
                         next.at AS midnight, \
                         ceil(extract(epoch FROM next.at - now()) * 1000)::bigint AS midnight_ms, \
                         (SELECT min(expires_at) FROM holds) AS lapse, \
                         ceil(extract(epoch FROM (SELECT min(expires_at) FROM holds) - clock_timestamp()) \
                             * 1000)::bigint AS lapse_ms \
                     FROM token_spend s, next \
                     WHERE s.tenant = $1 AND s.day = (now() AT TIME ZONE 'UTC')::date",
                )
                .bind::<BigInt, _>(owner)
                .bind::<Text, _>(hold.key)
                .get_result(conn)
                .await?;
                let wait = if day.spent >= token.budget {
                    if token.action == "die" {
                        return Ok(Budget::Die {
                            budget: token.budget,
                            spent: day.spent,
                        });
                    }
                    Some((day.midnight, day.midnight_ms, false))
                } else {
                    let taken = day.spent.saturating_add(day.held);
                    if taken > 0 && taken.saturating_add(hold.tokens) > token.budget {
                        // Kept by other calls' holds: until the first lapses
                        // (an answer settling one wakes it sooner). Kept by
                        // the spend alone (what is left is less than it may
                        // use): until the next day, or a budget raised.
                        Some(match (day.lapse, day.lapse_ms) {
                            (Some(until), Some(left_ms)) if until < day.midnight => {
                                (until, left_ms, true)
                            }
                            _ => (day.midnight, day.midnight_ms, day.held > 0),
                        })
                    } else {
                        None
                    }
                };
                if let Some((until, left_ms, reserved)) = wait {
                    let waiting = crate::rules::wait_machine::Waiting::Budget { until, reserved };
                    if !super::waits::release_until(conn, fence, &waiting, until).await? {
                        return Ok(Budget::Fenced);
                    }
                    return Ok(Budget::Wait {
                        until,
                        left_ms,
                        reserved,
                    });
                }
                sql("INSERT INTO budget_holds (call_key, tenant, day, tokens, expires_at) \
                     VALUES ($1, $2, (now() AT TIME ZONE 'UTC')::date, $3, \
                         clock_timestamp() + $4 * interval '1 millisecond') \
                     ON CONFLICT (call_key) DO UPDATE SET tenant = excluded.tenant, \
                         day = excluded.day, tokens = excluded.tokens, expires_at = excluded.expires_at")
                .bind::<Text, _>(hold.key)
                .bind::<BigInt, _>(owner)
                .bind::<BigInt, _>(hold.tokens)
                .bind::<BigInt, _>(hold.for_ms)
                .execute(conn)
                .await?;
                Ok(Budget::Open { held: true })
            })
            .await
        })
        .await
    }

    /// Drops call `key`'s budget hold: the call failed, and is held again
    /// when it is sent again.
    pub async fn release_hold(self, key: &str) -> Result<(), StoreError> {
        let mut conn = self.db().conn().await?;
        sql("DELETE FROM budget_holds WHERE call_key = $1")
            .bind::<Text, _>(key)
            .execute(&mut conn)
            .await?;
        Ok(())
    }

    /// Wakes the jobs of tenant `owner` that other calls' holds kept
    /// waiting (`waiting: {"kind": "budget", "reserved": true}`): an answer
    /// settled a hold, so there may be room. One indexed update (the
    /// waiting jobs by kind), and a `NOTIFY` when it woke any.
    pub async fn wake_held(self, owner: i64) -> Result<u64, StoreError> {
        wake_budget_waiters(self.db(), owner, true).await
    }

    /// Today's spend of every token with a budget (`owner`: that token's
    /// alone), by name.
    pub async fn spend_today(self, owner: Option<i64>) -> Result<Vec<Spend>, StoreError> {
        let mut conn = self.db().conn().await?;
        Ok(sql(
            "SELECT t.name AS token, coalesce(s.tokens, 0) AS spent_today, \
                 t.daily_token_budget AS daily_budget \
             FROM api_tokens t LEFT JOIN token_spend s ON s.tenant = t.id \
                 AND s.day = (now() AT TIME ZONE 'UTC')::date \
             WHERE t.daily_token_budget IS NOT NULL AND ($1::bigint IS NULL OR t.id = $1) \
             ORDER BY t.name",
        )
        .bind::<Nullable<BigInt>, _>(owner)
        .load(&mut conn)
        .await?)
    }
}

/// The output a budget holds for a request that does not bound its own
/// (no `max_tokens` nor `max_completion_tokens`).
pub const DEFAULT_OUTPUT_HOLD: i64 = 4_096;

/// What a model call `request` holds of its tenant's budget: its input's
/// estimate (a token per four bytes of JSON) plus the output it allows, or
/// [`DEFAULT_OUTPUT_HOLD`] when it does not bound it.
pub fn hold_for(request: &serde_json::Value) -> i64 {
    let bounded = ["max_tokens", "max_completion_tokens"].iter().any(|k| {
        request
            .get(*k)
            .and_then(serde_json::Value::as_u64)
            .is_some()
    });
    // Clamped: a request asking for an absurd output holds a huge amount,
    // never an overflow.
    let estimate = (crate::rules::quota::estimate_tokens(request) as i64).clamp(0, i64::MAX / 4);
    if bounded {
        estimate
    } else {
        estimate.saturating_add(DEFAULT_OUTPUT_HOLD)
    }
}

/// Makes the budget-waiting jobs of tenant `owner` due now (only those
/// held by other calls' holds, with `only_reserved`), announcing them.
pub(crate) async fn wake_budget_waiters(
    db: &crate::db::Db,
    owner: i64,
    only_reserved: bool,
) -> Result<u64, StoreError> {
    #[derive(QueryableByName)]
    struct Woken {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = db.conn().await?;
    let woken: Woken = sql("WITH woken AS ( \
             UPDATE jobs SET run_at = now(), updated_at = now() \
             WHERE waiting->>'kind' = 'budget' AND waiting IS NOT NULL AND tenant = $1 \
               AND finished_at IS NULL AND lease_owner IS NULL AND run_at > now() \
               AND (NOT $2 OR waiting->>'reserved' = 'true') \
             RETURNING id) \
         SELECT count(*) AS n FROM woken \
         WHERE (SELECT count(*) FROM (SELECT pg_notify($3, 'budget') \
             WHERE EXISTS (SELECT 1 FROM woken)) told) >= 0")
    .bind::<BigInt, _>(owner)
    .bind::<Bool, _>(only_reserved)
    .bind::<Text, _>(super::rows::NEW_JOB_CHANNEL)
    .get_result(&mut conn)
    .await?;
    Ok(woken.n.max(0) as u64)
}
