//! API tokens: created and revoked by the operator (`onceflow token …`),
//! stored as their SHA-256, looked up by it on every authenticated request.

use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use sha2::{Digest, Sha256};

use super::sql::sql;
use super::Tokens;
use crate::error::StoreError;

/// Who is calling, once their token checked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The token's id; jobs it submits belong to it.
    pub token: i64,
    /// Sees and acts on every job.
    pub admin: bool,
}

/// A caller as recorded in history rows: `token:<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallerName(pub String);

/// A token as `token list` shows it (never the token itself).
#[derive(Debug, Clone, QueryableByName)]
pub struct TokenInfo {
    /// The token's id; the jobs it submitted belong to it.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Its unique name, as history rows record it (`token:<name>`).
    #[diesel(sql_type = Text)]
    pub name: String,
    /// Whether it sees and acts on every job.
    #[diesel(sql_type = Bool)]
    pub admin: bool,
    /// When it was created.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// When it was revoked (`None`: live).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Its share of the nodes' turns when several tenants wait (1–1000).
    #[diesel(sql_type = Integer)]
    pub weight: i32,
    /// The most jobs of one of its concurrency keys that run at once
    /// (`None`: the workflow's limit, or 1).
    #[diesel(sql_type = Nullable<Integer>)]
    pub key_concurrency: Option<i32>,
    /// Its budget of model tokens per UTC day (`None`: no budget).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub daily_token_budget: Option<i64>,
    /// What a job does once the budget is spent: `wait` or `die`.
    #[diesel(sql_type = Text)]
    pub budget_exhausted: String,
    /// At most this many jobs of one of its concurrency keys start per
    /// [`key_throttle_period_s`](Self::key_throttle_period_s) (`None`: no
    /// throttle of its own).
    #[diesel(sql_type = Nullable<Integer>)]
    pub key_throttle: Option<i32>,
    /// The throttle's period, in seconds.
    #[diesel(sql_type = Nullable<Integer>)]
    pub key_throttle_period_s: Option<i32>,
}

/// How a token shares the nodes (`token create|set --weight --key-concurrency`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Share {
    /// Its weight between tenants (1–1000); `None`: unchanged (1 when new).
    pub weight: Option<i32>,
    /// Its limit per concurrency key (1–1000); `None`: unchanged (none when new).
    pub key_concurrency: Option<i32>,
    /// Its budget of model tokens per UTC day (at least 1); `None`:
    /// unchanged (none when new).
    pub daily_token_budget: Option<i64>,
    /// What a job does once the budget is spent: `wait` (for the next UTC
    /// day) or `die` (`budget_exhausted`); `None`: unchanged (`wait`).
    pub budget_exhausted: Option<&'static str>,
    /// Its throttle per concurrency key: starts, per this many seconds
    /// (1–1000 starts, 1 s to 1 day); `None`: unchanged (none when new).
    pub key_throttle: Option<(i32, i32)>,
    /// Settings removed (`token set --clear …`): the token falls back to
    /// the workflow's limit or throttle (or none), or has no budget.
    pub clear: Cleared,
}

/// The settings of a [`Share`] that `token set --clear` removes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cleared {
    /// `--clear key-concurrency`.
    pub key_concurrency: bool,
    /// `--clear daily-token-budget`.
    pub daily_token_budget: bool,
    /// `--clear key-throttle`.
    pub key_throttle: bool,
}

/// Parses a throttle as `--key-throttle` takes it: `STARTS/PERIOD`, the
/// period a number with a unit (`s`, `m`, `h`, `d`), as `10/60s`, `100/1h`.
/// Returns the starts and the period in seconds.
pub fn parse_throttle(text: &str) -> Result<(i32, i32), String> {
    let usage = "must be STARTS/PERIOD, as 10/60s or 100/1h (1 to 1000 starts per 1s to 1d)";
    let (starts, period) = text.split_once('/').ok_or(usage)?;
    let starts: i32 = starts.trim().parse().map_err(|_| usage)?;
    let period = period.trim();
    let unit = match period.chars().last() {
        Some('s') => 1,
        Some('m') => 60,
        Some('h') => 3600,
        Some('d') => 86_400,
        _ => return Err(usage.into()),
    };
    let count: i64 = period[..period.len() - 1].parse().map_err(|_| usage)?;
    let seconds = count.saturating_mul(unit);
    if !(1..=1000).contains(&starts) || !(1..=86_400).contains(&seconds) {
        return Err(usage.into());
    }
    Ok((starts, seconds as i32))
}

impl Share {
    /// Checks both bounds, naming the flag that is out of them.
    pub fn check(&self) -> Result<(), TokenError> {
        if self.weight.is_some_and(|w| !(1..=1000).contains(&w)) {
            return Err(TokenError::OutOfBounds("--weight"));
        }
        if self
            .key_concurrency
            .is_some_and(|k| !(1..=1000).contains(&k))
        {
            return Err(TokenError::OutOfBounds("--key-concurrency"));
        }
        if self.daily_token_budget.is_some_and(|b| b < 1) {
            return Err(TokenError::OutOfBounds("--daily-token-budget"));
        }
        if self
            .key_throttle
            .is_some_and(|(n, s)| !(1..=1000).contains(&n) || !(1..=86_400).contains(&s))
        {
            return Err(TokenError::OutOfBounds("--key-throttle"));
        }
        let both = [
            (
                self.key_concurrency.is_some() && self.clear.key_concurrency,
                "--key-concurrency",
            ),
            (
                self.daily_token_budget.is_some() && self.clear.daily_token_budget,
                "--daily-token-budget",
            ),
            (
                self.key_throttle.is_some() && self.clear.key_throttle,
                "--key-throttle",
            ),
        ];
        if let Some((_, flag)) = both.iter().find(|(b, _)| *b) {
            return Err(TokenError::SetAndCleared(flag));
        }
        Ok(())
    }
}

/// Why a token could not be created.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// A token of that name exists or existed (names are never reused).
    #[error("a token named {0:?} already exists (names are never reused, even once revoked)")]
    NameTaken(String),
    /// The name is not 1 to 100 characters of `A-Z a-z 0-9 _ . : -`.
    #[error("token names are 1 to 100 characters of A-Z a-z 0-9 _ . : -")]
    BadName,
    /// A share's number is out of its bounds (1 to 1000; a budget at least 1).
    #[error("{0} is out of bounds (1 to 1000; a budget at least 1)")]
    OutOfBounds(&'static str),
    /// A setting both given and cleared.
    #[error("{0} is both given and cleared (--clear); give one")]
    SetAndCleared(&'static str),
    /// No token by that name.
    #[error("no token named {0:?}")]
    Unknown(String),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The SHA-256 (hex) a token is stored and looked up as.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Tokens<'_> {
    /// Creates a token; returns it (shown once: only its hash is kept). A
    /// token that is not admin gets a webhook signing secret of its own
    /// ([`Self::secret`]): its jobs are signed with it.
    pub async fn create(self, name: &str, admin: bool) -> Result<String, TokenError> {
        if name.is_empty()
            || name.len() > 100
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'))
        {
            return Err(TokenError::BadName);
        }
        let secret: [u8; 32] = rand::random();
        let token = format!("of_{}", hex::encode(secret));
        let webhook_secret = (!admin).then(crate::rules::event::new_secret);
        let mut conn = self.db().conn().await.map_err(TokenError::Store)?;
        let inserted = sql(
            "INSERT INTO api_tokens (name, token_hash, admin, webhook_secret) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind::<Text, _>(name)
        .bind::<Text, _>(token_hash(&token))
        .bind::<Bool, _>(admin)
        .bind::<Nullable<Text>, _>(webhook_secret)
        .execute(&mut conn)
        .await
        .map_err(|e| TokenError::Store(e.into()))?;
        if inserted == 0 {
            return Err(TokenError::NameTaken(name.to_owned()));
        }
        Ok(token)
    }

    /// Every token, oldest first (revoked ones included, marked).
    pub async fn list(self) -> Result<Vec<TokenInfo>, StoreError> {
        let mut conn = self.db().conn().await?;
        Ok(sql(
            "SELECT id, name, admin, created_at, revoked_at, weight, key_concurrency, \
                 daily_token_budget, budget_exhausted, key_throttle, key_throttle_period_s \
             FROM api_tokens ORDER BY id",
        )
        .load(&mut conn)
        .await?)
    }

    /// Changes how token `name` shares the nodes: its weight, its limit per
    /// concurrency key (for jobs submitted from now on), or both. The
    /// weight counts from the next acquire on every node.
    pub async fn set_share(self, name: &str, share: Share) -> Result<(), TokenError> {
        share.check()?;
        let mut conn = self.db().conn().await.map_err(TokenError::Store)?;
        let n = sql("UPDATE api_tokens SET weight = coalesce($2, weight), \
                 key_concurrency = CASE WHEN $8 THEN NULL ELSE coalesce($3, key_concurrency) END, \
                 daily_token_budget = CASE WHEN $9 THEN NULL \
                     ELSE coalesce($4, daily_token_budget) END, \
                 budget_exhausted = coalesce($5, budget_exhausted), \
                 key_throttle = CASE WHEN $10 THEN NULL ELSE coalesce($6, key_throttle) END, \
                 key_throttle_period_s = CASE WHEN $10 THEN NULL \
                     ELSE coalesce($7, key_throttle_period_s) END \
             WHERE name = $1")
        .bind::<Text, _>(name)
        .bind::<Nullable<Integer>, _>(share.weight)
        .bind::<Nullable<Integer>, _>(share.key_concurrency)
        .bind::<Nullable<BigInt>, _>(share.daily_token_budget)
        .bind::<Nullable<Text>, _>(share.budget_exhausted)
        .bind::<Nullable<Integer>, _>(share.key_throttle.map(|t| t.0))
        .bind::<Nullable<Integer>, _>(share.key_throttle.map(|t| t.1))
        .bind::<diesel::sql_types::Bool, _>(share.clear.key_concurrency)
        .bind::<diesel::sql_types::Bool, _>(share.clear.daily_token_budget)
        .bind::<diesel::sql_types::Bool, _>(share.clear.key_throttle)
        .execute(&mut conn)
        .await
        .map_err(|e| TokenError::Store(e.into()))?;
        if n == 0 {
            return Err(TokenError::Unknown(name.to_owned()));
        }
        // A budget raised or cleared may leave room: the token's jobs held
        // by it are made due now and announced (each checks again).
        if share.daily_token_budget.is_some() || share.clear.daily_token_budget {
            #[derive(QueryableByName)]
            struct Id {
                #[diesel(sql_type = BigInt)]
                id: i64,
            }
            let ids: Vec<Id> = sql("SELECT id FROM api_tokens WHERE name = $1")
                .bind::<Text, _>(name)
                .load(&mut conn)
                .await
                .map_err(|e| TokenError::Store(e.into()))?;
            for Id { id } in ids {
                super::budgets::wake_budget_waiters(self.db(), id, false)
                    .await
                    .map_err(TokenError::Store)?;
            }
        }
        Ok(())
    }

    /// Revokes the token `name`; false when there is no live token by that name.
    pub async fn revoke(self, name: &str) -> Result<bool, StoreError> {
        let mut conn = self.db().conn().await?;
        // Announced in the same statement: its streams end at once.
        let n = sql("WITH revoked AS ( \
                 UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL \
                 RETURNING id) \
             SELECT pg_notify($2, id::text) FROM revoked")
        .bind::<Text, _>(name)
        .bind::<Text, _>(super::streams::TOKENS_CHANNEL)
        .execute(&mut conn)
        .await?;
        Ok(n == 1)
    }

    /// The webhook signing secret(s) of the token named `name`
    /// (space-separated, newest first); `None` for an admin token or one
    /// made before tokens had their own, whose jobs the node's
    /// `ONCEFLOW_WEBHOOK_SECRET` signs.
    pub async fn secret(self, name: &str) -> Result<Option<String>, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Nullable<Text>)]
            webhook_secret: Option<String>,
        }
        let mut conn = self.db().conn().await?;
        let rows: Vec<Row> = sql("SELECT webhook_secret FROM api_tokens WHERE name = $1")
            .bind::<Text, _>(name)
            .load(&mut conn)
            .await?;
        Ok(rows.into_iter().next().and_then(|r| r.webhook_secret))
    }

    /// The webhook signing secret(s) of token `id` (see [`Self::secret`]).
    pub async fn secret_of(self, id: i64) -> Result<Option<String>, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Nullable<Text>)]
            webhook_secret: Option<String>,
        }
        retrying!(self, "token_secret_of", async || {
            let mut conn = self.db().conn().await?;
            let rows: Vec<Row> = sql("SELECT webhook_secret FROM api_tokens WHERE id = $1")
                .bind::<BigInt, _>(id)
                .load(&mut conn)
                .await?;
            Ok(rows.into_iter().next().and_then(|r| r.webhook_secret))
        })
        .await
    }

    /// Live tokens that are not admin and have no signing secret of their
    /// own (made before tokens had one): their jobs are signed with the
    /// node's secret, which every tenant's consumer then trusts.
    pub async fn without_secret(self) -> Result<Vec<String>, StoreError> {
        #[derive(QueryableByName)]
        struct Name {
            #[diesel(sql_type = Text)]
            name: String,
        }
        let mut conn = self.db().conn().await?;
        let rows: Vec<Name> = sql("SELECT name FROM api_tokens \
             WHERE NOT admin AND revoked_at IS NULL AND webhook_secret IS NULL ORDER BY id")
        .load(&mut conn)
        .await?;
        Ok(rows.into_iter().map(|r| r.name).collect())
    }

    /// Gives the live, non-admin token `name` a new signing secret; the
    /// newest previous one keeps signing beside it until the next
    /// rotation, so consumers can switch over. Returns the new secret.
    pub async fn rotate_secret(self, name: &str) -> Result<String, StoreError> {
        let new = crate::rules::event::new_secret();
        let mut conn = self.db().conn().await?;
        // Announced in the same statement: every node signs with it at once.
        let n = sql("WITH rotated AS ( \
                 UPDATE api_tokens SET webhook_secret = \
                     $2 || coalesce(' ' || split_part(webhook_secret, ' ', 1), '') \
                 WHERE name = $1 AND NOT admin AND revoked_at IS NULL RETURNING id) \
             SELECT pg_notify($3, id::text) FROM rotated")
        .bind::<Text, _>(name)
        .bind::<Text, _>(&new)
        .bind::<Text, _>(super::streams::TOKENS_CHANNEL)
        .execute(&mut conn)
        .await?;
        if n == 0 {
            return Err(StoreError::InvalidData(format!(
                "no live, non-admin token named {name:?} (admin tokens sign with ONCEFLOW_WEBHOOK_SECRET)"
            )));
        }
        Ok(new)
    }

    /// The name of token `id` (for history rows).
    pub async fn name(self, id: i64) -> Result<Option<String>, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Text)]
            name: String,
        }
        let mut conn = self.db().conn().await?;
        let rows: Vec<Row> = sql("SELECT name FROM api_tokens WHERE id = $1")
            .bind::<BigInt, _>(id)
            .load(&mut conn)
            .await?;
        Ok(rows.into_iter().next().map(|r| r.name))
    }

    /// The live token with this value, if any.
    pub async fn authenticate(self, token: &str) -> Result<Option<Caller>, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            id: i64,
            #[diesel(sql_type = Bool)]
            admin: bool,
        }
        let mut conn = self.db().auth_conn().await?;
        let rows: Vec<Row> =
            sql("SELECT id, admin FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL")
                .bind::<Text, _>(token_hash(token))
                .load(&mut conn)
                .await?;
        Ok(rows.into_iter().next().map(|r| Caller {
            token: r.id,
            admin: r.admin,
        }))
    }

    /// Whether token `id` is live (not revoked).
    pub async fn live(self, id: i64) -> Result<bool, StoreError> {
        #[derive(QueryableByName)]
        struct Live {
            #[diesel(sql_type = Bool)]
            live: bool,
        }
        let mut conn = self.db().auth_conn().await?;
        let row: Live = sql(
            "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE id = $1 AND revoked_at IS NULL) AS live",
        )
        .bind::<BigInt, _>(id)
        .get_result(&mut conn)
        .await?;
        Ok(row.live)
    }

    /// Jobs that belong to no token (submitted in development mode): only
    /// admin tokens see them once tokens exist.
    pub async fn unowned_jobs(self) -> Result<i64, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let mut conn = self.db().conn().await?;
        let row: Row = sql("SELECT count(*) AS n FROM jobs WHERE owner_token IS NULL")
            .get_result(&mut conn)
            .await?;
        Ok(row.n)
    }

    /// Whether the API requires a token: a live token exists, or a revoked
    /// one the operator has not released ([`Self::open_development_mode`]).
    /// Revoking the last token never reopens the API by itself.
    pub async fn exist(self) -> Result<bool, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Bool)]
            exists: bool,
        }
        let mut conn = self.db().auth_conn().await?;
        let row: Row =
            sql("SELECT EXISTS (SELECT 1 FROM api_tokens WHERE released_at IS NULL) AS exists")
                .get_result(&mut conn)
                .await?;
        Ok(row.exists)
    }

    /// Releases every revoked token, so that with no live token a loopback
    /// server answers without one again (development mode). Refused while
    /// a live token exists; returns how many were released.
    pub async fn open_development_mode(self) -> Result<u64, StoreError> {
        let mut conn = self.db().conn().await?;
        #[derive(QueryableByName)]
        struct Live {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let live: Live = sql("SELECT count(*) AS n FROM api_tokens WHERE revoked_at IS NULL")
            .get_result(&mut conn)
            .await?;
        if live.n > 0 {
            return Err(StoreError::InvalidData(format!(
                "{} live token(s) exist: revoke them first (`onceflow token list`)",
                live.n
            )));
        }
        let n = sql("UPDATE api_tokens SET released_at = now() WHERE released_at IS NULL AND revoked_at IS NOT NULL")
            .execute(&mut conn)
            .await?;
        Ok(n as u64)
    }
}
