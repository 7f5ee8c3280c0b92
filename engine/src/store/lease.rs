//! Leases, heartbeats and fenced checkpoints.
//!
//! A node takes runnable jobs with `FOR UPDATE SKIP LOCKED`, bumping each
//! job's `lease_epoch` (the fencing token). Every later write of the attempt
//! is conditional on that epoch: zero rows changed is a typed outcome, never
//! silently ignored.

use diesel::sql_types::{Array, BigInt, Bool, Integer, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

pub use super::rows::Checkpoint;
use super::rows::{lock_in_order, parse_state, IdRow};
use super::sql::sql;
use super::Store;
use super::{Jobs, Leases};
use crate::error::{ErrorEnvelope, StoreError};
use crate::request::JobRequest;
use crate::rules::lifecycle::JobState;
use crate::rules::traceparent::TraceParent;

/// The identity of one attempt: every write it makes is guarded by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The job the attempt runs.
    pub job_id: String,
    /// Which life of the id this is (1 unless it was purged and submitted again).
    pub incarnation: i32,
    /// The lease epoch this attempt took: the fencing token every write checks.
    pub epoch: i64,
    /// The job's attempt count, this attempt included.
    pub attempt: i32,
    /// The node holding the lease.
    pub worker: String,
}

impl Fence {
    /// The prefix of every idempotency key of this job's incarnation.
    pub fn key(&self) -> crate::rules::keys::JobKey {
        crate::rules::keys::JobKey::new(&self.job_id, self.incarnation)
    }
}

/// A job leased to this node.
#[derive(Debug, Clone)]
pub struct Leased {
    /// The attempt's fence.
    pub fence: Fence,
    /// The name of the workflow the job runs.
    pub workflow: String,
    /// The version of the workflow the job started on: it runs on no other.
    pub workflow_version: i32,
    /// The stored request.
    pub request: JobRequest,
    /// The state the job is resumed from (its last checkpoint).
    pub state: JobState,
    /// The node that held the (expired) lease before us, if any: a takeover.
    pub previous_owner: Option<String>,
    /// The job's trace (stored at intake).
    pub trace: Option<TraceParent>,
    /// Earlier attempts that ended on a database error past its in-place
    /// retries (not its leases: redrives and takeovers do not count).
    pub store_failures: i32,
    /// The API token that submitted the job: its webhooks are signed with
    /// that token's own secret.
    pub owner_token: Option<i64>,
    /// When the throttle start slot the job holds frees, from the acquire
    /// (a job of a throttled key): the node polls then, so the key's next
    /// job starts when its slot frees, not at a later poll.
    pub throttle_frees_in: Option<std::time::Duration>,
}

#[derive(QueryableByName)]
struct LeasedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    workflow: String,
    #[diesel(sql_type = Integer)]
    workflow_version: i32,
    #[diesel(sql_type = Jsonb)]
    request: Value,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    incarnation: i32,
    #[diesel(sql_type = BigInt)]
    lease_epoch: i64,
    #[diesel(sql_type = Nullable<Text>)]
    previous_owner: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    trace_context: Option<String>,
    #[diesel(sql_type = Integer)]
    store_failures: i32,
    #[diesel(sql_type = Nullable<BigInt>)]
    owner_token: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    throttle_frees_ms: Option<i64>,
}

/// What one heartbeat did: how many leases it extended, and which it found
/// lost (see [`Leases::renew`]). A job its own attempt finished or released
/// meanwhile is in neither.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Renewal {
    /// Leases extended.
    pub renewed: usize,
    /// Jobs whose epoch moved on (a takeover, a cancel) or whose row is gone.
    pub lost: Vec<String>,
}

#[derive(QueryableByName)]
struct StateRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    lease_epoch: i64,
}

/// How often an acquire that lost a key slot to another node is run again
/// at once (each loss means another node leased a job: progress).
const KEY_SLOT_RETRIES: usize = 8;

/// Whether job `j` may be leased now: live, due, of a workflow this node
/// runs, not running here, unleased (or its lease lapsed, or — reclaiming —
/// this node's own), with a slot of its key free (or its own), and — a
/// throttled key — a start slot free (or started before: its stamp).
macro_rules! runnable {
    () => {
        "j.finished_at IS NULL AND j.run_at <= now() \
           AND (j.lease_expires_at IS NULL OR j.lease_expires_at < clock_timestamp() \
                OR ($4 AND j.lease_owner = $1)) \
           AND ($5::text[] IS NULL OR j.workflow || '@' || j.workflow_version = ANY($5)) \
           AND NOT (j.id = ANY($6)) \
           AND (j.concurrency_key IS NULL OR j.key_slot IS NOT NULL \
                OR (SELECT count(*) FROM jobs k WHERE k.tenant = j.tenant \
                      AND k.concurrency_key = j.concurrency_key AND k.key_slot IS NOT NULL) \
                   < coalesce(j.concurrency_limit, 1)) \
           AND (j.throttle_limit IS NULL OR j.throttle_slot IS NOT NULL \
                OR EXISTS (SELECT 1 FROM throttle_free_slots(j.tenant, j.concurrency_key, \
                               j.throttle_limit, j.throttle_period_s)))"
    };
}

/// The acquire: fair between tenants, bounded per concurrency key.
///
/// Between tenants it is start-time fair queueing: each tenant has a pass
/// (`tenant_turns`, the virtual time after its last start, moved on by
/// `1 / weight` per start), and the next start goes to the lowest. A tenant
/// that comes back after a pause is first brought up to the clock, so it
/// gets its share from now on, not a burst for the time it was away.
///
/// - `clock`: the latest a tenant that has been taking its turns can be
///   behind: the pass of the live tenant furthest ahead less one of its
///   starts (one probe of the index `tenant_turns_live`); a pass below it
///   is raised to it, so a tenant back from a pause takes its turns from
///   now, without a burst for the time it was away.
/// - `zero`: whether tenant 0 (admin tokens, development mode) cuts ahead:
///   the priority of its first runnable job, when above 0.
/// - `turns`, `walk`: the live tenants (those with an unfinished job:
///   `tenant_turns.live`, set by the intake's trigger, cleared by
///   [`Leases::rest_idle_tenants`]) in order of pass, then, walking that
///   order, the first `2 · limit` with a job that may run now (one probe
///   each, the walk ending there: with every tenant backlogged, `2 · limit`
///   probes however many tenants there are). Twice `limit`, so that two
///   nodes acquiring at once (each skipping the other's locked rows) both
///   find a full answer.
/// - `ready`: those tenants (and tenant 0 when it cuts ahead), each with
///   its weight and its pass raised to the clock.
/// - `bound`: with at least `limit` tenants ready, the pass of the last
///   of them (the `2 · limit`-th at most): each ready tenant has a job
///   whose turn is at most that (its first), so no job with a later turn
///   is needed, and each tenant's line is cut at the jobs whose turn could
///   reach it (one more for rounding, and never below one): with many
///   tenants backlogged each reads a job or two, not `limit`. With fewer
///   than `limit` tenants, no cut.
/// - `lines`: each ready tenant's first runnable jobs (up to `limit`, and
///   to `bound`; up to `limit` for tenant 0 when it cuts ahead) in its own
///   order (priority, then due time); `krn` numbers, within its key, the
///   jobs of a key that need a new slot, and `trn` those of a throttled
///   key that have never started (a start slot each); `key_t_*` is the
///   throttle of the first of them.
/// - `heads`: the lines without the keyed jobs their key has no free slot
///   (or start slot) for, nor those whose throttle is not the one of their
///   key's first job (one statement gives a key's start slots under one
///   throttle only: two lists of free slots could name the same slot) (so a busy key neither holds back its tenant's other jobs nor
///   counts against the tenant's turns); `rn` is a job's place in its
///   tenant's line.
/// - `ranked`: a job's turn is its tenant's pass plus `(rn - 1) / weight`;
///   a positive priority of tenant 0 ranks ahead of turns (`cut`).
/// - `slotted`: the `krn`-th free slot of its key, or none (the job waits);
///   likewise the `trn`-th free start slot, with its next generation
///   (`jobs_throttle_slots` decides a race for it, as for a key slot).
/// - `queue`, `locked`, `picked`: the candidates' ids (and the epochs they
///   were read at) in order of turn, one array each; the first `limit` of
///   them locked in that order, the lease checked again on each row's
///   latest version, so a job another node leased meanwhile is skipped.
///   The lock is `FOR NO KEY UPDATE`, as the update's own (it changes no
///   key): a foreign-key check's share lock on a queued job (a signal or a
///   stream watcher inserted for it) does not make the acquire skip it.
///   The rows are found through the primary key by the array (`= ANY`),
///   one probe per candidate: joined to `slotted` instead, the planner
///   probed the whole array once per candidate (256 × 256 at 16 tenants)
///   or could hash the whole table.
/// - `advanced`: each tenant taken from moves past its last start (never
///   back, should two nodes take its jobs at once).
/// - `fired`, then the update: as before, a due timer's outcome and the
///   lease with its slot and, at a job's first start, its start slot; a wait for a budget (due: its day has come) is
///   cleared, and the body checks the budget again at its next call.
const ACQUIRE: &str = concat!(
    "WITH clock AS ( \
         SELECT coalesce(( \
             SELECT t.pass - 1 / coalesce((SELECT k.weight FROM api_tokens k \
                     WHERE k.id = t.tenant AND t.tenant <> 0), 1)::float8 \
             FROM tenant_turns t WHERE t.live ORDER BY t.pass DESC LIMIT 1), 0) AS now), \
     zero AS ( \
         SELECT coalesce(( \
             SELECT greatest(j.priority, 0) FROM jobs j WHERE j.tenant = 0 AND ",
    runnable!(),
    " ORDER BY j.priority DESC, j.run_at LIMIT 1), 0) AS cut), \
     turns AS MATERIALIZED ( \
         SELECT t.tenant, t.pass FROM tenant_turns t WHERE t.live ORDER BY t.pass, t.tenant), \
     walk AS ( \
         SELECT t.tenant, t.pass FROM turns t \
         WHERE EXISTS (SELECT 1 FROM jobs j WHERE j.tenant = t.tenant AND ",
    runnable!(),
    ") \
         LIMIT 2 * $2), \
     ready AS MATERIALIZED ( \
         SELECT w.tenant, coalesce((SELECT k.weight FROM api_tokens k \
                 WHERE k.id = w.tenant AND w.tenant <> 0), 1)::float8 AS weight, \
             greatest(w.pass, c.now) AS pass, CASE WHEN w.tenant = 0 THEN z.cut ELSE 0 END AS cut \
         FROM (SELECT * FROM walk UNION \
               SELECT t.tenant, t.pass FROM tenant_turns t, zero z \
               WHERE t.tenant = 0 AND z.cut > 0) w \
             CROSS JOIN clock c CROSS JOIN zero z), \
     bound AS ( \
         SELECT CASE WHEN count(*) >= $2 THEN max(pass) END AS turn \
         FROM ready WHERE cut = 0), \
     lines AS ( \
         SELECT c.*, t.weight, t.pass, \
             CASE WHEN c.concurrency_key IS NOT NULL AND c.own_slot IS NULL THEN \
                 row_number() OVER (PARTITION BY c.tenant, c.concurrency_key, c.own_slot IS NULL \
                                    ORDER BY c.priority DESC, c.run_at, c.id) END AS krn, \
             CASE WHEN c.t_limit IS NOT NULL AND c.own_tslot IS NULL THEN \
                 row_number() OVER (PARTITION BY c.tenant, c.concurrency_key, \
                                        c.t_limit IS NOT NULL AND c.own_tslot IS NULL \
                                    ORDER BY c.priority DESC, c.run_at, c.id) END AS trn, \
             first_value(c.t_limit) OVER key_line AS key_t_limit, \
             first_value(c.t_period) OVER key_line AS key_t_period \
         FROM ready t CROSS JOIN bound b CROSS JOIN LATERAL ( \
             SELECT j.id, j.tenant, j.priority, j.run_at, j.lease_epoch, j.concurrency_key, \
                 coalesce(j.concurrency_limit, 1) AS key_limit, j.key_slot AS own_slot, \
                 j.throttle_limit AS t_limit, j.throttle_period_s AS t_period, \
                 j.throttle_slot AS own_tslot \
             FROM jobs j WHERE j.tenant = t.tenant AND ",
    runnable!(),
    " ORDER BY j.priority DESC, j.run_at \
             LIMIT CASE WHEN t.cut > 0 OR b.turn IS NULL THEN $2 \
                 ELSE least($2, greatest(floor((b.turn - t.pass) * t.weight)::bigint + 2, 1)) END) c \
         WINDOW key_line AS (PARTITION BY c.tenant, c.concurrency_key, \
                                 c.t_limit IS NOT NULL AND c.own_tslot IS NULL \
                             ORDER BY c.priority DESC, c.run_at, c.id)), \
     heads AS ( \
         SELECT l.*, row_number() OVER (PARTITION BY l.tenant ORDER BY l.priority DESC, l.run_at, l.id) AS rn \
         FROM lines l \
         WHERE (l.krn IS NULL OR l.krn <= l.key_limit - (SELECT count(*) FROM jobs k \
             WHERE k.tenant = l.tenant AND k.concurrency_key = l.concurrency_key \
               AND k.key_slot IS NOT NULL)) \
           AND (l.trn IS NULL OR (l.t_limit = l.key_t_limit AND l.t_period = l.key_t_period \
               AND l.trn <= (SELECT count(*) FROM throttle_free_slots( \
                   l.tenant, l.concurrency_key, l.t_limit, l.t_period))))), \
     ranked AS ( \
         SELECT h.*, h.pass + (h.rn - 1) / h.weight AS turn, \
             CASE WHEN h.tenant = 0 THEN greatest(h.priority, 0) ELSE 0 END AS cut \
         FROM heads h), \
     slotted AS ( \
         SELECT r.*, CASE WHEN r.krn IS NULL THEN r.own_slot ELSE ( \
             SELECT s FROM generate_series(0, r.key_limit - 1) s \
             WHERE NOT EXISTS (SELECT 1 FROM jobs k WHERE k.tenant = r.tenant \
                 AND k.concurrency_key = r.concurrency_key AND k.key_slot = s) \
             ORDER BY s OFFSET r.krn - 1 LIMIT 1) END AS slot, t.tslot, t.tgen \
         FROM ranked r LEFT JOIN LATERAL ( \
             SELECT f.slot AS tslot, f.gen AS tgen \
             FROM throttle_free_slots(r.tenant, r.concurrency_key, r.t_limit, r.t_period) f \
             WHERE r.trn IS NOT NULL ORDER BY f.slot OFFSET r.trn - 1 LIMIT 1) t ON true), \
     queue AS ( \
         SELECT array_agg(id::text ORDER BY cut DESC, turn, priority DESC, run_at, id) AS ids, \
             array_agg(lease_epoch ORDER BY cut DESC, turn, priority DESC, run_at, id) AS epochs \
         FROM slotted WHERE (krn IS NULL OR slot IS NOT NULL) AND (trn IS NULL OR tslot IS NOT NULL)), \
     locked AS ( \
         SELECT j.id, j.lease_owner, j.waiting \
         FROM queue q CROSS JOIN LATERAL unnest(q.ids, q.epochs) WITH ORDINALITY AS c(id, epoch, ord) \
             JOIN jobs j ON j.id = c.id \
         WHERE j.lease_epoch = c.epoch AND j.finished_at IS NULL \
           AND (j.lease_expires_at IS NULL OR j.lease_expires_at < clock_timestamp() \
                OR ($4 AND j.lease_owner = $1)) \
         ORDER BY c.ord \
         LIMIT $2 \
         FOR NO KEY UPDATE OF j SKIP LOCKED), \
     picked AS ( \
         SELECT l.id, l.lease_owner, l.waiting, s.slot, s.tslot, s.tgen, s.tenant, s.turn, s.weight \
         FROM locked l JOIN slotted s ON s.id = l.id), \
     advanced AS ( \
         INSERT INTO tenant_turns (tenant, pass, live) \
         SELECT tenant, max(turn + 1 / weight), true FROM picked GROUP BY tenant ORDER BY tenant \
         ON CONFLICT (tenant) DO UPDATE SET pass = greatest(tenant_turns.pass, excluded.pass)), \
     fired AS ( \
         UPDATE waits w SET outcome = $7, done_at = now() \
         FROM picked WHERE w.job_id = picked.id AND picked.waiting->>'kind' = 'sleep' \
           AND w.kind = 'sleep' AND w.name = picked.waiting->>'name' \
           AND w.done_at IS NULL AND w.until <= now() \
         RETURNING w.job_id) \
     UPDATE jobs j SET lease_owner = $1, lease_epoch = j.lease_epoch + 1, \
         lease_expires_at = clock_timestamp() + $3 * interval '1 millisecond', \
         attempts = j.attempts + 1, updated_at = now(), key_slot = picked.slot, \
         throttle_slot = coalesce(j.throttle_slot, picked.tslot), \
         throttle_gen = coalesce(j.throttle_gen, picked.tgen), \
         throttle_at = CASE WHEN j.throttle_slot IS NULL AND picked.tslot IS NOT NULL \
             THEN clock_timestamp() ELSE j.throttle_at END, \
         waiting = CASE WHEN j.id IN (SELECT job_id FROM fired) OR j.waiting->>'kind' = 'budget' \
             THEN NULL ELSE j.waiting END \
     FROM picked WHERE j.id = picked.id \
     RETURNING j.id, j.workflow, j.workflow_version, j.request, j.state::text AS state, j.attempts, j.incarnation, j.lease_epoch, \
         picked.lease_owner AS previous_owner, j.trace_context, j.store_failures, j.owner_token, \
         CASE WHEN j.throttle_at IS NOT NULL THEN ceil(extract(epoch FROM \
             j.throttle_at + make_interval(secs => j.throttle_period_s) - clock_timestamp()) * 1000)::bigint \
         END AS throttle_frees_ms"
);

impl Leases<'_> {
    /// Leases up to `limit` runnable jobs to `node` for `lease_ms`: jobs due
    /// to run that nobody holds, and jobs whose lease expired (a crashed or
    /// stalled attempt, on any node). With `reclaim_own`, also jobs still
    /// leased to `node` itself: a node that just started has nothing in
    /// flight, so whatever it held belonged to its previous incarnation.
    ///
    /// Only jobs of `workflows` (`name@version`, those registered on this
    /// node: [`Registry::runnable`](crate::Registry::runnable); `None`: any) are taken,
    /// and never one in `running` (this node's attempts still alive: a lease
    /// that lapsed while its heartbeat failed is not taken over by the node
    /// that holds it, so one job has at most one actor per node).
    ///
    /// Between tenants, turns decide (see [`ACQUIRE`]): a tenant's
    /// priority orders its own jobs only. A job with a concurrency key is
    /// taken only into a free slot of its key; one of a throttled key, at
    /// its first start, only into a free start slot of its key.
    ///
    /// A job picked up because its timer (`ctx.sleep`) is due has the
    /// timer's outcome recorded in the same statement, under the new lease:
    /// a due timer's outcome is fixed (`{"slept": true}`), so the attempt's
    /// replay reads it from the journal instead of a transaction of its own.
    pub async fn acquire(
        self,
        node: &str,
        limit: i64,
        lease_ms: i64,
        reclaim_own: bool,
        workflows: Option<&[String]>,
        running: &[String],
    ) -> Result<Vec<Leased>, StoreError> {
        let mut conn = self.db().conn().await?;
        // Two nodes that give the last free slot of a key (or one start
        // slot of a throttled key) to two jobs at once: the unique index
        // `jobs_key_slots` (`jobs_throttle_slots`) fails the later statement,
        // which leased nothing, and a fresh read sees the slot taken.
        let mut tries = 0;
        let rows: Vec<LeasedRow> = loop {
            let attempt = sql(ACQUIRE)
                .bind::<Text, _>(node)
                .bind::<BigInt, _>(limit)
                .bind::<BigInt, _>(lease_ms)
                .bind::<Bool, _>(reclaim_own)
                .bind::<Nullable<Array<Text>>, _>(workflows)
                .bind::<Array<Text>, _>(running)
                // A due timer's outcome, as the wait machine writes it.
                .bind::<Jsonb, _>(crate::rules::wait_machine::WaitOutcome::Slept(true).to_json())
                .load(&mut conn)
                .await;
            // Two acquires that give out slots of two keys in opposite
            // orders may also wait on each other's index entries: the
            // database breaks that deadlock (40P01) by failing one, run
            // again too. diesel folds 40P01 into `Unknown` with the code
            // out of reach (see `StoreError::is_retryable`); a statement
            // error leaves the connection usable.
            let lost_race = |e: &diesel::result::Error| {
                use diesel::result::DatabaseErrorKind as K;
                matches!(
                    e,
                    diesel::result::Error::DatabaseError(K::UniqueViolation | K::Unknown, _)
                )
            };
            match attempt {
                Err(e) if lost_race(&e) && tries < KEY_SLOT_RETRIES => tries += 1,
                other => break other?,
            }
        };
        rows.into_iter()
            .map(|r| {
                Ok(Leased {
                    state: parse_state(&r.state)?,
                    fence: Fence {
                        job_id: r.id,
                        incarnation: r.incarnation,
                        epoch: r.lease_epoch,
                        attempt: r.attempts,
                        worker: node.to_owned(),
                    },
                    workflow: r.workflow,
                    workflow_version: r.workflow_version,
                    request: JobRequest::from_stored(r.request),
                    previous_owner: r.previous_owner,
                    trace: r.trace_context.as_deref().and_then(TraceParent::parse),
                    store_failures: r.store_failures,
                    owner_token: r.owner_token,
                    throttle_frees_in: r
                        .throttle_frees_ms
                        .map(|ms| std::time::Duration::from_millis(ms.max(0) as u64)),
                })
            })
            .collect()
    }

    /// Marks not live the tenants that have no unfinished job left, so the
    /// acquire's walk (see [`ACQUIRE`]) no longer reads them; returns how
    /// many. Run by a node's supervisor when a job ends there (at once, then
    /// at most every 5 s; a node that ends nothing never runs it): a tenant
    /// left live costs the walk one probe while its pass is among the
    /// lowest, and nothing else.
    ///
    /// Cannot leave a tenant with a job not live: the rows are locked
    /// `FOR UPDATE SKIP LOCKED` first, which leaves out every tenant an
    /// open intake's trigger saw live (it holds a `KEY SHARE` lock on the
    /// row until it commits), and the jobs of the rest are then read again
    /// by a statement of its own, with a new snapshot. An intake that comes
    /// after the lock waits for this transaction, then finds the tenant not
    /// live and marks it again (`tenant_mark_live`). Skipping, never
    /// waiting, it cannot deadlock with a transaction that makes jobs of
    /// several tenants live (a firing of schedules), nor hold up intakes.
    /// Tests: `fairness::the_idle_sweep_leaves_a_tenant_with_an_open_intake_in_the_walk`,
    /// `fairness::an_intake_behind_the_sweeps_lock_puts_its_tenant_back`,
    /// `fairness::a_tenant_left_idle_comes_back_with_its_next_job`.
    pub async fn rest_idle_tenants(self) -> Result<usize, StoreError> {
        retrying!(self, "rest_idle_tenants", async || {
            #[derive(QueryableByName)]
            struct Tenant {
                #[diesel(sql_type = BigInt)]
                tenant: i64,
            }
            macro_rules! idle {
                () => {
                    "t.live AND NOT EXISTS (SELECT 1 FROM jobs j \
                     WHERE j.tenant = t.tenant AND j.finished_at IS NULL)"
                };
            }
            let mut conn = self.db().conn().await?;
            let idle: Vec<Tenant> = sql(concat!(
                "SELECT t.tenant FROM tenant_turns t WHERE ",
                idle!(),
                " ORDER BY t.tenant"
            ))
            .load(&mut conn)
            .await?;
            if idle.is_empty() {
                return Ok(0);
            }
            let idle: Vec<i64> = idle.into_iter().map(|t| t.tenant).collect();
            conn.transaction::<_, StoreError, _>(async |conn| {
                let locked: Vec<Tenant> = sql("SELECT tenant FROM tenant_turns \
                     WHERE tenant = ANY($1) ORDER BY tenant FOR UPDATE SKIP LOCKED")
                .bind::<Array<BigInt>, _>(&idle)
                .load(conn)
                .await?;
                let locked: Vec<i64> = locked.into_iter().map(|t| t.tenant).collect();
                let rested = sql(concat!(
                    "UPDATE tenant_turns t SET live = false WHERE t.tenant = ANY($1) AND ",
                    idle!()
                ))
                .bind::<Array<BigInt>, _>(&locked)
                .execute(conn)
                .await?;
                Ok(rested)
            })
            .await
        })
        .await
    }

    /// Extends the leases `node` holds on `held` (job id, epoch) in one
    /// statement; returns how many it extended and the ids whose lease is
    /// lost: the epoch moved on (a takeover, a cancel) or the row is gone. A
    /// job the attempt finished or released itself keeps its epoch and is in
    /// neither.
    pub async fn renew(
        self,
        node: &str,
        held: &[(String, i64)],
        lease_ms: i64,
    ) -> Result<Renewal, StoreError> {
        if held.is_empty() {
            return Ok(Renewal::default());
        }
        let mut conn = self.db().lease_conn().await?;
        Store::renew_on(&mut conn, node, held, lease_ms).await
    }

    /// Takes node name `node` on a dedicated connection of its own and keeps
    /// it for as long as the returned hold lives: `None` when another live
    /// node has it. Every `every`, the connection is checked (`SELECT 1`);
    /// when it has dropped or hangs for 5 s (a database restart, a
    /// failover), the name is taken again on a new connection, and if it is
    /// still taken at the third check (a twin took it meanwhile) the hold
    /// reports it lost ([`NodeIdHold::lost`]): the node must stop, as
    /// the twin would have refused to start had the connection stayed up.
    pub async fn hold_node_id(
        self,
        node: &str,
        every: std::time::Duration,
    ) -> Result<Option<NodeIdHold>, StoreError> {
        let mut conn = self.db().dedicated().await?;
        if !Store::lock_node_id(&mut conn, node).await? {
            return Ok(None);
        }
        let (tx, lost) = tokio::sync::oneshot::channel();
        let (db, node) = (self.db().clone(), node.to_owned());
        self.db().spawn(async move {
            let mut tx = tx;
            let mut conn = Some(conn);
            let mut refused = 0;
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                if let Some(c) = conn.as_mut() {
                    // Bounded: a half-open connection must not hide a drop.
                    let alive = tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        diesel_async::SimpleAsyncConnection::batch_execute(c, "SELECT 1"),
                    )
                    .await;
                    if matches!(alive, Ok(Ok(()))) {
                        refused = 0;
                        continue;
                    }
                    tracing::warn!(node = %node, "the connection holding this node's name dropped; taking the name again");
                    conn = None;
                }
                let taken = match db.dedicated().await {
                    Ok(mut c) => Store::lock_node_id(&mut c, &node).await.map(|t| (t, c)),
                    Err(e) => Err(e),
                };
                match taken {
                    Ok((true, c)) => {
                        tracing::warn!(node = %node, "this node's name is held again");
                        conn = Some(c);
                    }
                    // The old backend may hold the lock a little longer
                    // (it has not noticed the dropped connection yet): a
                    // lock still refused after three checks is a twin's.
                    Ok((false, _)) if refused < 2 => {
                        refused += 1;
                        tracing::warn!(node = %node, "this node's name is still locked (the old connection's backend, or a twin); checking again");
                    }
                    Ok((false, _)) => {
                        let said = format!(
                            "another node took the name {node:?} (ONCEFLOW_NODE_ID) while this \
                             node's connection was down: two nodes under one name would renew and \
                             release each other's leases, so this one stops"
                        );
                        tracing::error!("{said}");
                        let _ = tx.send(said);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, node = %node, "could not take this node's name again; will retry");
                    }
                }
            }
        });
        Ok(Some(NodeIdHold { lost }))
    }

    /// Whether `fence` still holds its unfinished job (no cancel, no
    /// takeover): the check before a send that follows no fenced write.
    pub async fn holds(self, fence: &Fence) -> Result<bool, StoreError> {
        retrying!(self, "holds", async || {
            let mut conn = self.db().conn().await?;
            let rows: Vec<IdRow> = sql(
                "SELECT id FROM jobs WHERE id = $1 AND lease_epoch = $2 AND finished_at IS NULL",
            )
            .bind::<Text, _>(&fence.job_id)
            .bind::<BigInt, _>(fence.epoch)
            .load(&mut conn)
            .await?;
            Ok(rows.len() == 1)
        })
        .await
    }

    /// Releases the lease and schedules the job to run again `delay` from
    /// now by the database's clock (every node's `run_at <= now()` reads
    /// the same clock), keeping its state (a retry after a transient
    /// failure); `store_failure` counts a database error that ended the
    /// attempt.
    pub async fn reschedule(
        self,
        fence: &Fence,
        delay: std::time::Duration,
        error: &ErrorEnvelope,
        store_failure: bool,
    ) -> Result<Checkpoint, StoreError> {
        retrying!(self, "reschedule", async || {
            self.reschedule_once(fence, delay, error, store_failure)
                .await
        })
        .await
    }

    async fn reschedule_once(
        self,
        fence: &Fence,
        delay: std::time::Duration,
        error: &ErrorEnvelope,
        store_failure: bool,
    ) -> Result<Checkpoint, StoreError> {
        let mut conn = self.db().conn().await?;
        let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX / 2);
        let moved = sql(
            "UPDATE jobs SET run_at = clock_timestamp() + $3 * interval '1 millisecond', last_error = $4, \
                 lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL, updated_at = now(), \
                 store_failures = store_failures + CASE WHEN $5 THEN 1 ELSE 0 END \
             WHERE id = $1 AND lease_epoch = $2 AND finished_at IS NULL",
        )
        .bind::<Text, _>(&fence.job_id)
        .bind::<BigInt, _>(fence.epoch)
        .bind::<BigInt, _>(delay_ms)
        .bind::<Jsonb, _>(serde_json::to_value(error).expect("envelope serialises"))
        .bind::<Bool, _>(store_failure)
        .execute(&mut conn)
        .await?;
        if moved == 1 {
            return Ok(Checkpoint::Moved);
        }
        Store::why_not(&mut conn, fence).await
    }

    /// Releases every lease `node` holds, so another node resumes those jobs
    /// at once instead of after the lease expires (a graceful shutdown).
    /// Returns how many were released.
    pub async fn release_all(self, node: &str) -> Result<usize, StoreError> {
        let mut conn = self.db().conn().await?;
        let released = sql(
            "UPDATE jobs SET lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL, updated_at = now() \
             WHERE lease_owner = $1 AND finished_at IS NULL",
        )
        .bind::<Text, _>(node)
        .execute(&mut conn)
        .await?;
        drop(conn);
        // Its provider slots too (calls it abandoned hold none).
        self.limits().release_node_slots(node).await?;
        Ok(released)
    }
}

impl Store {
    pub(crate) async fn renew_on(
        conn: &mut AsyncPgConnection,
        node: &str,
        held: &[(String, i64)],
        lease_ms: i64,
    ) -> Result<Renewal, StoreError> {
        let ids: Vec<String> = held.iter().map(|(id, _)| id.clone()).collect();
        let epochs: Vec<i64> = held.iter().map(|(_, e)| *e).collect();
        #[derive(QueryableByName)]
        struct RenewRow {
            #[diesel(sql_type = Text)]
            id: String,
            #[diesel(sql_type = Bool)]
            renewed: bool,
            #[diesel(sql_type = Bool)]
            lost: bool,
        }
        let rows: Vec<RenewRow> = sql(
            // Rows locked in id order, as batched checkpoints lock theirs, so
            // a heartbeat and a batch never wait on each other in a cycle
            // (see `LOCK_IN_ORDER`). Lost is judged on `locked`, the rows'
            // latest versions: a job whose epoch moved on (a takeover, a
            // cancel) or whose row is gone. A job the attempt itself
            // finished or released while the heartbeat waited for its row
            // keeps its epoch and is not lost — its actor is ending anyway,
            // and calling it lost would log a takeover that never happened.
            concat!(
                "WITH ",
                lock_in_order!("$2"),
                ", held AS (SELECT * FROM unnest((SELECT $2::text[]), (SELECT $3::bigint[])) AS l(id, epoch)), \
                 renewed AS ( \
                     UPDATE jobs j SET lease_expires_at = clock_timestamp() + $4 * interval '1 millisecond' \
                     FROM held l \
                     WHERE j.id = l.id AND j.lease_epoch = l.epoch AND j.lease_owner = $1 \
                       AND (SELECT count(*) FROM locked) >= 0 \
                     RETURNING j.id) \
                 SELECT l.id, r.id IS NOT NULL AS renewed, \
                        (k.id IS NULL OR k.lease_epoch <> l.epoch) AS lost \
                 FROM held l LEFT JOIN locked k ON k.id = l.id LEFT JOIN renewed r ON r.id = l.id"
            ),
        )
        .bind::<Text, _>(node)
        .bind::<Array<Text>, _>(&ids)
        .bind::<Array<BigInt>, _>(&epochs)
        .bind::<BigInt, _>(lease_ms)
        .load(conn)
        .await?;
        Ok(Renewal {
            renewed: rows.iter().filter(|r| r.renewed).count(),
            lost: rows.into_iter().filter(|r| r.lost).map(|r| r.id).collect(),
        })
    }

    /// Takes node name `node` for as long as `conn` (a dedicated
    /// connection) stays open: a session advisory lock on the name. False
    /// when another live node holds it; two nodes under one name would
    /// each renew, reclaim and release the other's leases.
    pub async fn lock_node_id(
        conn: &mut AsyncPgConnection,
        node: &str,
    ) -> Result<bool, StoreError> {
        #[derive(QueryableByName)]
        struct Locked {
            #[diesel(sql_type = Bool)]
            locked: bool,
        }
        let row: Locked = sql("SELECT pg_try_advisory_lock(7310586, hashtext($1)) AS locked")
            .bind::<Text, _>(node)
            .get_result(conn)
            .await?;
        Ok(row.locked)
    }

    pub(crate) async fn hold_fence(
        conn: &mut AsyncPgConnection,
        fence: &Fence,
    ) -> Result<bool, StoreError> {
        let rows: Vec<IdRow> =
            sql("SELECT id FROM jobs WHERE id = $1 AND lease_epoch = $2 FOR NO KEY UPDATE")
                .bind::<Text, _>(&fence.job_id)
                .bind::<BigInt, _>(fence.epoch)
                .load(conn)
                .await?;
        Ok(rows.len() == 1)
    }

    /// Dead-letters the job from whatever live state it is in, keeping the reason.
    pub(crate) async fn kill_in(
        conn: &mut AsyncPgConnection,
        fence: &Fence,
        reason: &str,
        error: &ErrorEnvelope,
    ) -> Result<Checkpoint, StoreError> {
        // With its job.dead event, when the job asked for failure events,
        // announced on EVENTS_CHANNEL so any node sends it at once.
        let error = serde_json::to_value(error).expect("envelope serialises");
        let body = crate::rules::event::body(
            crate::rules::keys::DEAD_EVENT,
            serde_json::json!({ "job_id": fence.job_id, "reason": reason, "error": error }),
            chrono::Utc::now(),
        );
        let moved = sql(
            "WITH moved AS ( \
                 UPDATE jobs SET state = 'dead', dead_reason = $3, last_error = $4, finished_at = now(), \
                     updated_at = now(), lease_owner = NULL, key_slot = NULL, lease_expires_at = NULL \
                 WHERE id = $1 AND lease_epoch = $2 AND finished_at IS NULL \
                 RETURNING id, request, notify_failures), \
             event AS ( \
                 INSERT INTO outbox (job_id, event, idempotency_key, url, body) \
                 SELECT id, $7, $8, request->>'webhook_url', $10 \
                 FROM moved WHERE notify_failures \
                 ON CONFLICT (job_id, event) DO UPDATE SET status = 'claimed', body = EXCLUDED.body, \
                     url = EXCLUDED.url, attempts = 0, run_at = now(), in_flight_until = NULL, \
                     last_error = NULL, last_status = NULL, updated_at = now() \
                 WHERE outbox.status = 'dead' AND outbox.last_error->>'code' = 'event_moot' \
                 RETURNING job_id), \
             told AS (SELECT pg_notify($9, job_id) FROM event) \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT id, 'dead', $5, $6 FROM moved WHERE (SELECT count(*) FROM told) >= 0",
        )
        .bind::<Text, _>(&fence.job_id)
        .bind::<BigInt, _>(fence.epoch)
        .bind::<Text, _>(reason)
        .bind::<Jsonb, _>(&error)
        .bind::<Integer, _>(fence.attempt)
        .bind::<Text, _>(&fence.worker)
        .bind::<Text, _>(crate::rules::keys::DEAD_EVENT)
        .bind::<Text, _>(crate::rules::keys::failure(&fence.key(), "dead"))
        .bind::<Text, _>(super::events::EVENTS_CHANNEL)
        .bind::<Jsonb, _>(&body)
        .execute(conn)
        .await?;
        if moved == 1 {
            return Ok(Checkpoint::Moved);
        }
        Store::why_not(conn, fence).await
    }

    /// Why a guarded update changed nothing.
    pub(crate) async fn why_not(
        conn: &mut AsyncPgConnection,
        fence: &Fence,
    ) -> Result<Checkpoint, StoreError> {
        let rows: Vec<StateRow> =
            sql("SELECT state::text AS state, lease_epoch FROM jobs WHERE id = $1")
                .bind::<Text, _>(&fence.job_id)
                .load(conn)
                .await?;
        match rows.into_iter().next() {
            Some(row) if row.lease_epoch == fence.epoch => {
                Ok(Checkpoint::AlreadyAt(parse_state(&row.state)?))
            }
            Some(_) | None => Ok(Checkpoint::LeaseLost),
        }
    }
}

impl Jobs<'_> {
    /// The current state of a job (for an attempt that lost a race).
    pub async fn state_of(self, job_id: &str) -> Result<Option<JobState>, StoreError> {
        retrying!(self, "state_of", async || {
            let mut conn = self.db().conn().await?;
            let rows: Vec<StateRow> =
                sql("SELECT state::text AS state, lease_epoch FROM jobs WHERE id = $1")
                    .bind::<Text, _>(job_id)
                    .load(&mut conn)
                    .await?;
            rows.into_iter()
                .next()
                .map(|r| parse_state(&r.state))
                .transpose()
        })
        .await
    }
}

/// A node's hold on its name (see [`Leases::hold_node_id`]); dropping it
/// gives the name up.
#[derive(Debug)]
pub struct NodeIdHold {
    lost: tokio::sync::oneshot::Receiver<String>,
}

impl NodeIdHold {
    /// Resolves, with what to say, if another node took the name while the
    /// hold's connection was down; never otherwise.
    pub async fn lost(&mut self) -> String {
        match (&mut self.lost).await {
            Ok(said) => said,
            Err(_) => std::future::pending().await,
        }
    }
}
