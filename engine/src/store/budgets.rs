//! Model-token budgets: a token's budget per UTC day, what its tenant spent
//! today (`token_spend`, added to when a model answer is recorded), and
//! the wait of a job whose tenant has spent it.

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
    /// Under its budget, or the call is answered already (a replay costs
    /// nothing), or no budget is set.
    Open,
    /// Spent: the job waits until `until` (the next UTC day).
    Wait {
        /// The next UTC midnight.
        until: chrono::DateTime<chrono::Utc>,
        /// Milliseconds until then, by the database's clock.
        left_ms: i64,
    },
    /// Spent, and the token says a job then dies (`budget_exhausted`).
    Die {
        /// The budget.
        budget: i64,
        /// What was spent today.
        spent: i64,
    },
}

#[derive(QueryableByName)]
struct BudgetRow {
    #[diesel(sql_type = BigInt)]
    budget: i64,
    #[diesel(sql_type = Text)]
    action: String,
    #[diesel(sql_type = BigInt)]
    spent: i64,
    #[diesel(sql_type = Bool)]
    answered: bool,
    #[diesel(sql_type = Timestamptz)]
    until: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = BigInt)]
    left_ms: i64,
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
    /// Whether a job of token `owner` may send model call `key` now. Only
    /// a token that is not admin and has a budget has one to check; a call
    /// already answered is a replay, which spends nothing.
    pub async fn budget(self, owner: Option<i64>, key: &str) -> Result<Budget, StoreError> {
        let Some(owner) = owner else {
            return Ok(Budget::Open);
        };
        retrying!(self, "budget", async || {
            let mut conn = self.db().conn().await?;
            let rows: Vec<BudgetRow> = sql(
                "WITH next AS (SELECT (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day') \
                     AT TIME ZONE 'UTC' AS at) \
                 SELECT t.daily_token_budget AS budget, t.budget_exhausted AS action, \
                     coalesce((SELECT s.tokens FROM token_spend s WHERE s.tenant = t.id \
                         AND s.day = (now() AT TIME ZONE 'UTC')::date), 0) AS spent, \
                     EXISTS (SELECT 1 FROM model_calls m WHERE m.idempotency_key = $2 \
                         AND m.status = 'completed') AS answered, \
                     next.at AS until, \
                     (extract(epoch FROM next.at - now()) * 1000)::bigint AS left_ms \
                 FROM api_tokens t, next \
                 WHERE t.id = $1 AND NOT t.admin AND t.daily_token_budget IS NOT NULL",
            )
            .bind::<BigInt, _>(owner)
            .bind::<Text, _>(key)
            .load(&mut conn)
            .await?;
            Ok(match rows.into_iter().next() {
                Some(r) if !r.answered && r.spent >= r.budget => {
                    if r.action == "die" {
                        Budget::Die {
                            budget: r.budget,
                            spent: r.spent,
                        }
                    } else {
                        Budget::Wait {
                            until: r.until,
                            left_ms: r.left_ms,
                        }
                    }
                }
                _ => Budget::Open,
            })
        })
        .await
    }

    /// Lets the job go until `until`, waiting for its budget (`waiting:
    /// {"kind": "budget", "until"}`, no lease; the next acquire after
    /// `until` clears it). False when the lease is lost.
    pub async fn wait_for_budget(
        self,
        fence: &Fence,
        until: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, StoreError> {
        let waiting = serde_json::json!({ "kind": "budget", "until": until });
        retrying!(self, "wait_for_budget", async || {
            let mut conn = self.db().conn().await?;
            super::waits::release_until(&mut conn, fence, &waiting, until).await
        })
        .await
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
