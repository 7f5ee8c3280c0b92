//! Schedules: their rows, and firing them. A firing locks the due
//! schedules' rows (`FOR UPDATE SKIP LOCKED`: each is fired by one node at
//! a time), and in one commit records each fire time once
//! (`schedule_fires`' primary key), inserts its job through intake's insert
//! (`{schedule id}:{YYYYMMDDTHHMMSSZ}`: an id that exists inserts nothing)
//! and moves `next_fire_at` on. A node killed mid-firing commits nothing,
//! and the next firing (on any node) does it all. A delete or pause takes
//! the same row lock, so nothing fires after it commits.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Bool, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl};
use serde::Serialize;
use serde_json::Value;

use super::group_writes::{intake_on, NewRow};
use super::sql::sql;
use super::Schedules;
use super::Store;
use crate::error::StoreError;
use crate::request::canonical_hash;
use crate::rules::schedule::{job_id, CatchUp, Timetable};

/// The `NOTIFY` channel a schedule created or resumed is announced on: the
/// nodes look for due schedules at once.
pub const SCHEDULES_CHANNEL: &str = super::rows::Channel::Schedules.name();

/// Schedules fired per statement.
const FIRE_BATCH: i64 = 20;

/// A schedule as `POST /v1/schedules` gives it, validated.
#[derive(Debug, Clone, Serialize)]
pub struct NewSchedule {
    /// Its id (a job of it is `{id}:{fire time}`).
    pub id: String,
    /// Five fields, or six with seconds first.
    pub cron: String,
    /// An IANA zone name.
    pub timezone: String,
    /// The workflow each job runs.
    pub workflow: String,
    /// Each job's input.
    pub input: Value,
    /// Each job's webhook.
    pub webhook_url: String,
    /// What happens to fire times missed while no node ran.
    pub catch_up: CatchUp,
}

/// One job a schedule created.
#[derive(Debug, Clone, Serialize, QueryableByName, PartialEq, utoipa::ToSchema)]
pub struct ScheduledJob {
    /// The job's id.
    #[diesel(sql_type = Text)]
    pub id: String,
    /// The fire time it was created for.
    #[diesel(sql_type = Timestamptz)]
    pub fire_at: DateTime<Utc>,
    /// Its state now (`None` once purged, or when it was skipped).
    #[diesel(sql_type = Nullable<Text>)]
    pub state: Option<String>,
    /// Why no job was made for this fire time (`backlog_full`: the
    /// schedule's token had as many unfinished jobs as it may), or `None`.
    #[diesel(sql_type = Nullable<Text>)]
    pub skipped: Option<String>,
}

/// A schedule as `GET /v1/schedules/{id}` shows it.
#[derive(Debug, Clone, Serialize, QueryableByName, utoipa::ToSchema)]
pub struct ScheduleView {
    /// Its id.
    #[diesel(sql_type = Text)]
    pub id: String,
    /// Its cron.
    #[diesel(sql_type = Text)]
    pub cron: String,
    /// Its time zone.
    #[diesel(sql_type = Text)]
    pub timezone: String,
    /// The workflow its jobs run.
    #[diesel(sql_type = Text)]
    pub workflow: String,
    /// Its jobs' input.
    #[diesel(sql_type = Jsonb)]
    #[schema(value_type = Object)]
    pub input: Value,
    /// Its jobs' webhook.
    #[diesel(sql_type = Text)]
    pub webhook_url: String,
    /// `latest`, `all` or `none`.
    #[diesel(sql_type = Text)]
    pub catch_up: String,
    /// Whether it is paused.
    #[diesel(sql_type = Bool)]
    pub paused: bool,
    /// When it fires next (`None` while paused).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub next_fire_at: Option<DateTime<Utc>>,
    /// When it was created.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// The token it belongs to (not shown).
    #[serde(skip)]
    #[diesel(sql_type = Nullable<BigInt>)]
    pub owner_token: Option<i64>,
}

/// A schedule with its latest jobs, newest first.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ScheduleDetail {
    /// The schedule.
    #[serde(flatten)]
    pub schedule: ScheduleView,
    /// Its latest ten jobs, newest first.
    pub latest_jobs: Vec<ScheduledJob>,
}

/// What creating a schedule did.
#[derive(Debug)]
pub enum ScheduleIntake {
    /// Created now (`201`).
    Created(ScheduleView),
    /// The same schedule was created before (`200`).
    Existing(ScheduleDetail),
    /// The id is taken by another schedule (`409`).
    Conflict,
    /// Nothing created: the token has this many schedules, its cap (`409`).
    TooMany(i64),
}

/// The first key of the advisory lock that serialises one token's
/// schedule creates (its second, the token id hashed).
const SCHEDULE_CAP_LOCK_CLASS: i32 = 0x6f66_7363; // "ofsc"

/// A workflow this node can fire schedules of.
#[derive(Debug, Clone)]
pub struct Fireable {
    /// Its name.
    pub workflow: String,
    /// The version a new job of it gets here (the highest registered).
    pub version: i32,
    /// Whether its jobs send failure events.
    pub notify_failures: bool,
}

/// What a firing did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Fired {
    /// Jobs created.
    pub jobs: usize,
    /// Jobs created, by workflow (for the intake metric).
    pub by_workflow: std::collections::BTreeMap<String, usize>,
    /// Schedules fired.
    pub schedules: usize,
    /// How long until the next schedule this node can fire is due (`None`:
    /// none is active).
    pub next_in: Option<std::time::Duration>,
}

/// The columns of a [`ScheduleView`].
macro_rules! view {
    () => {
        "SELECT id, cron, timezone, workflow, input, webhook_url, catch_up, paused, \
         CASE WHEN paused THEN NULL ELSE next_fire_at END AS next_fire_at, created_at, owner_token \
         FROM schedules"
    };
}

#[derive(QueryableByName)]
struct DueRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    owner_token: Option<i64>,
    #[diesel(sql_type = Text)]
    cron: String,
    #[diesel(sql_type = Text)]
    timezone: String,
    #[diesel(sql_type = Text)]
    workflow: String,
    #[diesel(sql_type = Jsonb)]
    input: Value,
    #[diesel(sql_type = Text)]
    webhook_url: String,
    #[diesel(sql_type = Text)]
    catch_up: String,
    #[diesel(sql_type = Timestamptz)]
    next_fire_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    db_now: DateTime<Utc>,
}

impl NewSchedule {
    /// The hash two submissions of one schedule share.
    fn hash(&self) -> String {
        canonical_hash(&serde_json::to_value(self).expect("a schedule serialises"))
    }
}

impl Schedules<'_> {
    /// Creates schedule `s` (its cron parsed as `table`) for token `owner`,
    /// first firing at its first fire time after now by the database's
    /// clock (which every node's firing reads too); the same schedule again
    /// is `Existing`, another under its id `Conflict`.
    pub async fn create(
        self,
        s: &NewSchedule,
        table: &Timetable,
        owner: Option<i64>,
        cap: Option<i64>,
    ) -> Result<ScheduleIntake, StoreError> {
        let hash = s.hash();
        let mut conn = self.db().conn().await?;
        let now = Store::db_now(&mut conn).await?;
        let Some(next_fire_at) = table.next_after(now) else {
            return Ok(ScheduleIntake::Conflict);
        };
        let (Some(owner_id), Some(cap)) = (owner, cap) else {
            return self.insert(&mut conn, s, &hash, owner, next_fire_at).await;
        };
        // The cap holds for the cluster: creates of one token take its lock
        // in turn, and each counts what the ones before it committed.
        use diesel_async::AsyncConnection as _;
        conn.transaction::<_, StoreError, _>(async move |conn| {
            sql("SELECT pg_advisory_xact_lock($1, hashint8($2))")
                .bind::<diesel::sql_types::Integer, _>(SCHEDULE_CAP_LOCK_CLASS)
                .bind::<BigInt, _>(owner_id)
                .execute(conn)
                .await?;
            #[derive(QueryableByName)]
            struct Held {
                #[diesel(sql_type = BigInt)]
                n: i64,
                #[diesel(sql_type = diesel::sql_types::Bool)]
                exists: bool,
            }
            let held: Held = sql(
                "SELECT (SELECT count(*) FROM schedules WHERE owner_token = $1) AS n, \
                     EXISTS (SELECT 1 FROM schedules WHERE id = $2) AS exists",
            )
            .bind::<BigInt, _>(owner_id)
            .bind::<Text, _>(&s.id)
            .get_result(conn)
            .await?;
            // An existing id is answered as before (its own again, or a
            // conflict): it creates nothing.
            if held.n >= cap && !held.exists {
                return Ok(ScheduleIntake::TooMany(held.n));
            }
            self.insert(conn, s, &hash, owner, next_fire_at).await
        })
        .await
    }

    async fn insert(
        self,
        conn: &mut diesel_async::AsyncPgConnection,
        s: &NewSchedule,
        hash: &str,
        owner: Option<i64>,
        next_fire_at: DateTime<Utc>,
    ) -> Result<ScheduleIntake, StoreError> {
        let created: Vec<ScheduleView> = sql(
            "WITH created AS ( \
                 INSERT INTO schedules (id, owner_token, cron, timezone, workflow, input, webhook_url, \
                     catch_up, body_hash, next_fire_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
                 ON CONFLICT (id) DO NOTHING \
                 RETURNING id, cron, timezone, workflow, input, webhook_url, catch_up, paused, \
                     next_fire_at, created_at, owner_token), \
             told AS (SELECT pg_notify($11, id) FROM created) \
             SELECT created.* FROM created LEFT JOIN told ON true",
        )
        .bind::<Text, _>(&s.id)
        .bind::<Nullable<BigInt>, _>(owner)
        .bind::<Text, _>(&s.cron)
        .bind::<Text, _>(&s.timezone)
        .bind::<Text, _>(&s.workflow)
        .bind::<Jsonb, _>(&s.input)
        .bind::<Text, _>(&s.webhook_url)
        .bind::<Text, _>(s.catch_up.as_str())
        .bind::<Text, _>(hash)
        .bind::<Timestamptz, _>(next_fire_at)
        .bind::<Text, _>(SCHEDULES_CHANNEL)
        .load(conn)
        .await?;
        if let Some(view) = created.into_iter().next() {
            return Ok(ScheduleIntake::Created(view));
        }
        #[derive(QueryableByName)]
        struct Stored {
            #[diesel(sql_type = Text)]
            body_hash: String,
            #[diesel(sql_type = Nullable<BigInt>)]
            owner_token: Option<i64>,
        }
        let stored: Vec<Stored> = sql("SELECT body_hash, owner_token FROM schedules WHERE id = $1")
            .bind::<Text, _>(&s.id)
            .load(conn)
            .await?;
        match stored.into_iter().next() {
            Some(st) if st.body_hash == hash && st.owner_token == owner => {
                match self.get(&s.id).await? {
                    Some(view) => Ok(ScheduleIntake::Existing(view)),
                    None => Ok(ScheduleIntake::Conflict), // deleted meanwhile
                }
            }
            _ => Ok(ScheduleIntake::Conflict),
        }
    }

    /// A page of the schedules of token `owner` (every token's with
    /// `all`), by id: up to `limit` after id `after`.
    pub async fn list(
        self,
        all: bool,
        token: Option<i64>,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<ScheduleView>, StoreError> {
        let mut conn = self.db().conn().await?;
        Ok(sql(concat!(
            view!(),
            " WHERE ($1 OR owner_token IS NOT DISTINCT FROM $2) AND ($3::text IS NULL OR id > $3) \
             ORDER BY id LIMIT $4"
        ))
        .bind::<Bool, _>(all)
        .bind::<Nullable<BigInt>, _>(token)
        .bind::<Nullable<Text>, _>(after)
        .bind::<BigInt, _>(limit)
        .load(&mut conn)
        .await?)
    }

    /// How many schedules token `owner` has.
    pub async fn count(self, owner: i64) -> Result<i64, StoreError> {
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let mut conn = self.db().conn().await?;
        let c: Count = sql("SELECT count(*) AS n FROM schedules WHERE owner_token = $1")
            .bind::<BigInt, _>(owner)
            .get_result(&mut conn)
            .await?;
        Ok(c.n)
    }

    /// Schedule `id` with its latest jobs, or `None`.
    pub async fn get(self, id: &str) -> Result<Option<ScheduleDetail>, StoreError> {
        let mut conn = self.db().conn().await?;
        let view: Vec<ScheduleView> = sql(concat!(view!(), " WHERE id = $1"))
            .bind::<Text, _>(id)
            .load(&mut conn)
            .await?;
        let Some(schedule) = view.into_iter().next() else {
            return Ok(None);
        };
        let jobs: Vec<ScheduledJob> = sql(
            "SELECT f.job_id AS id, f.fire_at, j.state::text AS state, f.skipped FROM schedule_fires f \
             JOIN schedules s ON s.id = f.schedule_id \
             LEFT JOIN jobs j ON j.id = f.job_id AND j.owner_token IS NOT DISTINCT FROM s.owner_token \
             WHERE f.schedule_id = $1 ORDER BY f.fire_at DESC LIMIT 10",
        )
        .bind::<Text, _>(id)
        .load(&mut conn)
        .await?;
        Ok(Some(ScheduleDetail {
            schedule,
            latest_jobs: jobs,
        }))
    }

    /// Deletes schedule `id` of token `scope` (`None`: any token's) — its
    /// jobs stay; `false` when there was none.
    pub async fn delete(self, id: &str, scope: Option<i64>) -> Result<bool, StoreError> {
        let mut conn = self.db().conn().await?;
        let n =
            sql("DELETE FROM schedules WHERE id = $1 AND ($2::bigint IS NULL OR owner_token = $2)")
                .bind::<Text, _>(id)
                .bind::<Nullable<BigInt>, _>(scope)
                .execute(&mut conn)
                .await?;
        Ok(n == 1)
    }

    /// Pauses schedule `id` of token `scope` (`None`: any token's), or
    /// resumes it: a paused schedule fires next at its first fire time after
    /// now by the database's clock, so the fire times passed while it was
    /// paused never fire (resuming one that is not paused changes nothing).
    /// `false` when there is none.
    pub async fn set_paused(
        self,
        id: &str,
        scope: Option<i64>,
        paused: bool,
    ) -> Result<bool, StoreError> {
        let mut conn = self.db().conn().await?;
        conn.transaction::<_, StoreError, _>(async |conn| {
            #[derive(QueryableByName)]
            struct Row {
                #[diesel(sql_type = Text)]
                cron: String,
                #[diesel(sql_type = Text)]
                timezone: String,
                #[diesel(sql_type = Bool)]
                paused: bool,
                #[diesel(sql_type = Timestamptz)]
                db_now: DateTime<Utc>,
            }
            let row: Vec<Row> = sql(
                "SELECT cron, timezone, paused, now() AS db_now FROM schedules \
                 WHERE id = $1 AND ($2::bigint IS NULL OR owner_token = $2) FOR UPDATE",
            )
            .bind::<Text, _>(id)
            .bind::<Nullable<BigInt>, _>(scope)
            .load(conn)
            .await?;
            let Some(row) = row.into_iter().next() else {
                return Ok(false);
            };
            if row.paused == paused {
                return Ok(true);
            }
            let next = if paused {
                None
            } else {
                Timetable::parse(&row.cron, &row.timezone)
                    .ok()
                    .and_then(|t| t.next_after(row.db_now))
            };
            sql("WITH moved AS ( \
                     UPDATE schedules SET paused = $2, next_fire_at = coalesce($3, next_fire_at), \
                         updated_at = now() \
                     WHERE id = $1 RETURNING id), \
                 told AS (SELECT pg_notify($4, id) FROM moved WHERE NOT $2) \
                 SELECT id FROM moved LEFT JOIN told ON true")
            .bind::<Text, _>(id)
            .bind::<Bool, _>(paused)
            .bind::<Nullable<Timestamptz>, _>(next)
            .bind::<Text, _>(SCHEDULES_CHANNEL)
            .execute(conn)
            .await?;
            Ok(true)
        })
        .await
    }

    /// Fires the due schedules of the workflows in `fireable` (see the
    /// module's documentation), at most a batch per call.
    ///
    /// A schedule of a token with `backlog` unfinished jobs or more makes
    /// no job for its fire time: the time is recorded `skipped`
    /// (`backlog_full`), shown in the schedule's latest jobs, and the
    /// schedule moves on, as a submit of that token would be refused.
    pub async fn fire(
        self,
        fireable: &[Fireable],
        backlog: Option<u64>,
    ) -> Result<Fired, StoreError> {
        let backlog = backlog.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
        let names: Vec<&str> = fireable.iter().map(|f| f.workflow.as_str()).collect();
        let mut conn = self.db().conn().await?;
        // One read when nothing is due (an idle node's case).
        let next_in = Store::next_schedule_in(&mut conn, &names).await?;
        if next_in.is_none_or(|d| !d.is_zero()) {
            return Ok(Fired {
                next_in,
                ..Fired::default()
            });
        }
        let mut fired = conn
            .transaction::<_, StoreError, _>(async |conn| {
                let due: Vec<DueRow> = sql(
                    "SELECT id, owner_token, cron, timezone, workflow, input, webhook_url, catch_up, \
                         next_fire_at, now() AS db_now FROM schedules \
                     WHERE NOT paused AND next_fire_at <= now() AND workflow = ANY($1) \
                       AND (owner_token IS NULL OR NOT EXISTS ( \
                           SELECT 1 FROM api_tokens t WHERE t.id = owner_token AND t.revoked_at IS NOT NULL)) \
                     ORDER BY next_fire_at LIMIT $2 FOR UPDATE SKIP LOCKED",
                )
                .bind::<Array<Text>, _>(&names)
                .bind::<BigInt, _>(FIRE_BATCH)
                .load(conn)
                .await?;
                let mut fired = Fired::default();
                for row in due {
                    let Some(target) = fireable.iter().find(|f| f.workflow == row.workflow) else {
                        continue;
                    };
                    let made = fire_one(conn, &row, target, backlog).await?;
                    fired.jobs += made;
                    if made > 0 {
                        *fired.by_workflow.entry(row.workflow.clone()).or_default() += made;
                    }
                    fired.schedules += 1;
                }
                Ok(fired)
            })
            .await?;
        fired.next_in = if fired.schedules as i64 == FIRE_BATCH {
            Some(std::time::Duration::ZERO) // a full batch: more may be due
        } else {
            Store::next_schedule_in(&mut conn, &names).await?
        };
        Ok(fired)
    }
}

impl Store {
    async fn db_now(
        conn: &mut diesel_async::AsyncPgConnection,
    ) -> Result<DateTime<Utc>, StoreError> {
        #[derive(QueryableByName)]
        struct Now {
            #[diesel(sql_type = Timestamptz)]
            now: DateTime<Utc>,
        }
        Ok(sql("SELECT now() AS now")
            .get_result::<Now>(conn)
            .await?
            .now)
    }

    /// How long until the next active schedule of `names` is due (zero:
    /// one is due now; `None`: none is active).
    async fn next_schedule_in(
        conn: &mut diesel_async::AsyncPgConnection,
        names: &[&str],
    ) -> Result<Option<std::time::Duration>, StoreError> {
        #[derive(QueryableByName)]
        struct Next {
            #[diesel(sql_type = Nullable<BigInt>)]
            ms: Option<i64>,
        }
        let next: Next = sql(
            "SELECT ceil(extract(epoch FROM min(next_fire_at) - now()) * 1000)::bigint AS ms \
             FROM schedules WHERE NOT paused AND workflow = ANY($1) \
               AND (owner_token IS NULL OR NOT EXISTS ( \
                   SELECT 1 FROM api_tokens t WHERE t.id = owner_token AND t.revoked_at IS NOT NULL))",
        )
        .bind::<Array<Text>, _>(names)
        .get_result(conn)
        .await?;
        Ok(next
            .ms
            .map(|ms| std::time::Duration::from_millis(ms.max(0) as u64)))
    }
}

/// Fires one due schedule in the firing's transaction: a job per fire time
/// its catch-up gives (as many as its token's backlog has room for; the
/// rest recorded `skipped`), each fire time recorded once (one recorded
/// before, its job maybe purged since, makes no job again), and its next
/// fire time (none: paused). Returns how many jobs it made.
async fn fire_one(
    conn: &mut diesel_async::AsyncPgConnection,
    row: &DueRow,
    target: &Fireable,
    backlog: Option<i64>,
) -> Result<usize, StoreError> {
    let (times, next) = match Timetable::parse(&row.cron, &row.timezone) {
        Ok(table) => table.due(
            row.next_fire_at,
            row.db_now,
            CatchUp::parse(&row.catch_up).unwrap_or(CatchUp::Latest),
        ),
        Err(e) => {
            tracing::warn!(schedule = row.id, error = %e, "a stored schedule no longer parses; paused");
            (Vec::new(), None)
        }
    };
    let mut rows: Vec<NewRow> = times.iter().map(|at| fired_job(row, target, *at)).collect();
    // The token's room: fire times past it are skipped.
    let room = room_of(conn, row.owner_token, backlog).await?;
    if rows.len() > room {
        let skipped: Vec<NewRow> = rows.split_off(room);
        let ids: Vec<&str> = skipped.iter().map(|r| r.id.as_str()).collect();
        tracing::warn!(
            schedule = row.id,
            skipped = ids.len(),
            "its token's backlog is full: fire times skipped"
        );
        sql(
            "INSERT INTO schedule_fires (schedule_id, fire_at, job_id, skipped) \
             SELECT $1, f.at, f.id, 'backlog_full' \
             FROM unnest($2::timestamptz[], $3::text[]) AS f(at, id) \
             ON CONFLICT DO NOTHING",
        )
        .bind::<Text, _>(&row.id)
        .bind::<Array<Timestamptz>, _>(&times[room..])
        .bind::<Array<Text>, _>(&ids)
        .execute(conn)
        .await?;
    }
    let made = record_and_insert(conn, &row.id, &times[..rows.len()], rows).await?;
    sql(
        "UPDATE schedules SET next_fire_at = coalesce($2, next_fire_at), \
             paused = paused OR $2 IS NULL, updated_at = now() WHERE id = $1",
    )
    .bind::<Text, _>(&row.id)
    .bind::<Nullable<Timestamptz>, _>(next)
    .execute(conn)
    .await?;
    Ok(made)
}

/// The job of schedule `row` for fire time `at`, made into its row by the
/// one intake every source shares ([`Submission::row`](super::Submission::row)).
fn fired_job(row: &DueRow, target: &Fireable, at: DateTime<Utc>) -> NewRow {
    let job = crate::request::NewJob {
        id: job_id(&row.id, at),
        workflow: row.workflow.clone(),
        workflow_version: target.version,
        input: row.input.clone(),
        webhook_url: row.webhook_url.clone(),
        tags: Default::default(),
        schedule: Default::default(),
    };
    // Bounded by the schedule's own count of its token's room, not the
    // statement's (a firing skips what does not fit, and says so).
    super::Submission::new(&job)
        .owned(row.owner_token, target.notify_failures)
        .row()
}

/// How many more unfinished jobs token `owner` may have (`backlog`).
async fn room_of(
    conn: &mut diesel_async::AsyncPgConnection,
    owner: Option<i64>,
    backlog: Option<i64>,
) -> Result<usize, StoreError> {
    let (Some(owner), Some(limit)) = (owner, backlog) else {
        return Ok(usize::MAX);
    };
    #[derive(QueryableByName)]
    struct Open {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let open: Open =
        sql("SELECT count(*) AS n FROM jobs WHERE owner_token = $1 AND finished_at IS NULL")
            .bind::<BigInt, _>(owner)
            .get_result(conn)
            .await?;
    Ok(usize::try_from((limit - open.n).max(0)).unwrap_or(usize::MAX))
}

/// Records each fire time of schedule `schedule` once, and makes the jobs
/// of those recorded now: a fire time recorded before (its job maybe
/// purged since) makes no job again. Returns how many jobs it made.
async fn record_and_insert(
    conn: &mut diesel_async::AsyncPgConnection,
    schedule: &str,
    times: &[DateTime<Utc>],
    rows: Vec<NewRow>,
) -> Result<usize, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    #[derive(QueryableByName)]
    struct Recorded {
        #[diesel(sql_type = Text)]
        job_id: String,
    }
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    let recorded: Vec<Recorded> = sql("INSERT INTO schedule_fires (schedule_id, fire_at, job_id) \
         SELECT $1, f.at, f.id FROM unnest($2::timestamptz[], $3::text[]) AS f(at, id) \
         ON CONFLICT DO NOTHING RETURNING job_id")
    .bind::<Text, _>(schedule)
    .bind::<Array<Timestamptz>, _>(times)
    .bind::<Array<Text>, _>(&ids)
    .load(conn)
    .await?;
    let new: Vec<NewRow> = rows
        .into_iter()
        .filter(|r| recorded.iter().any(|x| x.job_id == r.id))
        .collect();
    if new.is_empty() {
        return Ok(0);
    }
    let inserted = intake_on(conn, &new).await?;
    Ok(inserted.iter().filter(|r| r.is_some()).count())
}
