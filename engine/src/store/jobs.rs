//! Intake and the job view.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use serde::Serialize;
use serde_json::Value;

use super::rows::parse_state;
pub use super::rows::{INTAKE_WORKER, NEW_JOB_CHANNEL};
use super::sql::sql;
use super::Jobs;
use super::Leased;
use crate::error::{ErrorEnvelope, StoreError};
use crate::request::{JobRequest, NewJob};
use crate::rules::lifecycle::JobState;
use crate::rules::traceparent::TraceParent;

/// The node a new job is leased to in intake's own commit (a hand-off).
#[derive(Debug, Clone)]
pub struct HandTo {
    /// The node that reserved room for the job.
    pub node: String,
    /// The lease's length, in milliseconds.
    pub lease_ms: i64,
}

/// A job to record, in whose trace, for whom, and whether it is handed to
/// a node in intake's commit: what [`Jobs::submit`] takes.
#[derive(Debug, Clone)]
pub struct Submission<'a> {
    /// The job.
    pub job: &'a NewJob,
    /// The caller's trace, which the job's attempts continue (a new root
    /// unless given).
    pub trace: TraceParent,
    /// The API token the job belongs to (`None`: development mode).
    pub owner: Option<i64>,
    /// Whether the job sends its failure events to its webhook.
    pub notify_failures: bool,
    /// The node to hand a new job due now to (see [`crate::node::handoff`]).
    pub hand_to: Option<HandTo>,
    /// The most unfinished jobs its token may have, in the whole cluster:
    /// intake's own statement decides, under a lock per token, so two
    /// nodes taking a burst of submits at once admit no more than this
    /// between them (`None`: no bound, or no token).
    pub backlog_limit: Option<u64>,
    /// The job that started it (a child), when one did.
    pub parent: Option<String>,
}

impl<'a> Submission<'a> {
    /// `job`, in a trace of its own, of no token, handed to no node.
    pub fn new(job: &'a NewJob) -> Self {
        Submission {
            job,
            trace: TraceParent::new_root(),
            owner: None,
            notify_failures: false,
            hand_to: None,
            backlog_limit: None,
            parent: None,
        }
    }

    /// A child of job `parent` (of the life of it that holds its lease).
    pub fn child_of(mut self, parent: &str) -> Self {
        self.parent = Some(parent.to_owned());
        self
    }

    /// The row every source inserts (`group_writes::intake_on`): the one
    /// place a job becomes a row, whether it came through the API (a
    /// submit, a batch's item, a re-run), from a parent (a child), or from
    /// a schedule's firing — its request and hash, trace, owner, failure
    /// events, priority and delay, its key's limit and throttle, its
    /// parent, the backlog bound, and the hand-off's lease.
    pub(crate) fn row(&self) -> super::group_writes::NewRow {
        let job = self.job;
        let later = job.schedule.run_at.is_some() || job.schedule.delay_ms.is_some_and(|d| d > 0);
        // A job with a concurrency key takes a slot of its key when an
        // acquire leases it; it is never born leased.
        let hand_to = self
            .hand_to
            .as_ref()
            .filter(|_| !later && job.schedule.concurrency_key.is_none());
        let stored = job.request().to_value();
        super::group_writes::NewRow {
            id: job.id.clone(),
            workflow: job.workflow.clone(),
            workflow_version: job.workflow_version,
            request_hash: crate::request::canonical_hash(&stored),
            request: stored,
            trace: self.trace.to_string(),
            owner: self.owner,
            notify_failures: self.notify_failures && !job.webhook_url.is_empty(),
            priority: job.schedule.priority,
            run_at: job.schedule.run_at,
            delay_ms: job.schedule.delay_ms.map(|ms| ms as i64),
            lease: hand_to.map(|h| (h.node.clone(), h.lease_ms)),
            parent: self.parent.clone(),
            key_limit: job.schedule.concurrency_limit.map(|n| n.min(1000) as i32),
            throttle: job
                .schedule
                .throttle
                .map(|t| (t.starts as i32, t.per.as_secs() as i32)),
            backlog_limit: self
                .backlog_limit
                .filter(|_| self.owner.is_some())
                .map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
        }
    }

    /// Refused (`Intake::BacklogFull`) when its token already has `limit`
    /// unfinished jobs in the cluster; no bound without a token.
    pub fn limited(mut self, limit: u64) -> Self {
        self.backlog_limit = Some(limit);
        self
    }

    /// In the caller's trace.
    pub fn traced(mut self, trace: TraceParent) -> Self {
        self.trace = trace;
        self
    }

    /// On behalf of API token `owner`, sending failure events or not.
    pub fn owned(mut self, owner: Option<i64>, notify_failures: bool) -> Self {
        self.owner = owner;
        self.notify_failures = notify_failures;
        self
    }

    /// Handed to `node` if it is new and due now.
    pub fn handed_to(mut self, node: Option<HandTo>) -> Self {
        self.hand_to = node;
        self
    }
}

/// What a submission did.
#[derive(Debug)]
pub struct Submitted {
    /// The job created, found, or in conflict.
    pub intake: Intake,
    /// The lease of a job handed off in intake's commit, for its node to adopt.
    pub leased: Option<Leased>,
}

/// The outcome of a submission.
#[derive(Debug)]
pub enum Intake {
    /// A new job (201).
    Created(JobView),
    /// The same id with the same request (200): the stored job, untouched.
    Existing(JobView),
    /// The same id with a different request (409): the stored job, untouched.
    Conflict(JobView),
    /// Nothing stored: the job's token has this many unfinished jobs, its
    /// limit, in the cluster (429).
    BacklogFull(u64),
}

/// A job as `GET /v1/jobs/{id}` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct JobView {
    /// The job id (the client's business id).
    pub id: String,
    /// The name of the workflow it runs.
    pub workflow: String,
    /// The version of the workflow the job started on (and runs on).
    pub workflow_version: i32,
    /// Among due jobs, higher runs first.
    pub priority: i32,
    /// When the job may next start (its schedule, or a retry's backoff).
    pub run_at: DateTime<Utc>,
    /// Where the job is in its lifecycle.
    pub state: JobState,
    /// Attempts started so far (leases taken).
    pub attempts: i32,
    /// Which life of this id the job is: 1, or `n` when the id was purged
    /// (retention) and submitted again; its keys are then `job:{id}#{n}:…`.
    pub incarnation: i32,
    /// The workflow's input, as submitted.
    #[schema(value_type = Object)]
    pub input: Value,
    /// Where the outcome is delivered by webhook (empty: nowhere).
    pub webhook_url: String,
    /// Its tags (label → value).
    pub tags: crate::request::Tags,
    /// Its concurrency key, if it has one.
    pub concurrency_key: Option<String>,
    /// The workflow's output, once persisted.
    #[schema(value_type = Option<Object>)]
    pub result: Option<Value>,
    /// Every transition, oldest first.
    pub history: Vec<HistoryEntry>,
    /// The completion webhook's outbox row, once the delivery is claimed.
    pub delivery: Option<DeliveryView>,
    /// The most recent failure, if any.
    pub last_error: Option<ErrorEnvelope>,
    /// Why the job is dead (set exactly when it is).
    pub dead_reason: Option<String>,
    /// When the job was submitted.
    pub created_at: DateTime<Utc>,
    /// When the job row last changed.
    pub updated_at: DateTime<Utc>,
    /// When the job reached a final state (acked, dead or cancelled).
    pub finished_at: Option<DateTime<Utc>>,
    /// The W3C trace id every attempt and outgoing request of the job carries.
    pub trace_id: Option<String>,
    /// The API token that submitted it (`None`: no authentication). Not shown.
    #[serde(skip)]
    pub owner_token: Option<i64>,
    /// The model-call journal: key, status, sends, tokens.
    pub model_calls: Vec<ModelCallView>,
    /// The tool ledger: position, tool, call id, status, executions.
    pub tool_calls: Vec<ToolCallView>,
    /// What the job waits for, by `kind` (see [`Waiting`](crate::rules::wait_machine::Waiting),
    /// the one type it is written from and read back as), or `null`. It
    /// holds no lease meanwhile.
    #[schema(value_type = Option<crate::rules::wait_machine::Waiting>)]
    pub waiting: Option<Value>,
    /// The signals sent to the job, oldest first, each with the wait that
    /// took it (`taken_by`) or `null` while it is kept.
    pub signals: Vec<super::waits::SignalView>,
    /// The job whose workflow started this one (`ctx.spawn`), or `null`.
    pub parent: Option<String>,
    /// The child jobs this one started, oldest first (at most 1,000).
    pub children: Vec<ChildView>,
}

/// A child job as its parent's view shows it.
#[derive(Debug, Clone, Serialize, QueryableByName, utoipa::ToSchema)]
pub struct ChildView {
    /// The child's job id (`{parent id}:child:{name}`).
    #[diesel(sql_type = Text)]
    pub id: String,
    /// Its workflow.
    #[diesel(sql_type = Text)]
    pub workflow: String,
    /// Its state now.
    #[diesel(sql_type = Text)]
    pub state: String,
}

/// One model call as the job view shows it.
#[derive(Debug, Clone, Serialize, QueryableByName, utoipa::ToSchema)]
pub struct ModelCallView {
    /// The call's key (`job:{id}:{step}`), sent as `Idempotency-Key`.
    #[diesel(sql_type = Text)]
    pub idempotency_key: String,
    /// `pending`, `completed` or `failed`.
    #[diesel(sql_type = Text)]
    pub status: String,
    /// Sends of this call so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// Prompt tokens the provider reported.
    #[diesel(sql_type = Nullable<Integer>)]
    pub input_tokens: Option<i32>,
    /// Completion tokens the provider reported.
    #[diesel(sql_type = Nullable<Integer>)]
    pub output_tokens: Option<i32>,
    /// The last failed send's error envelope, if any.
    #[diesel(sql_type = Nullable<Jsonb>)]
    #[schema(value_type = Option<Object>)]
    pub last_error: Option<Value>,
}

/// One tool call as the job view shows it.
#[derive(Debug, Clone, Serialize, QueryableByName, utoipa::ToSchema)]
pub struct ToolCallView {
    /// The model turn that asked for the call (0-based).
    #[diesel(sql_type = Integer)]
    pub turn: i32,
    /// The call's position within its turn (0-based).
    #[diesel(sql_type = Integer)]
    pub index: i32,
    /// The tool called.
    #[diesel(sql_type = Text)]
    pub tool_name: String,
    /// The provider's id of the call (recorded, not trusted to be unique).
    #[diesel(sql_type = Text)]
    pub tool_call_id: String,
    /// `started`, `completed`, `failed`, or `unknown` (sent, its answer
    /// lost, and the tool may not run twice: a redrive needs
    /// `confirm_unknown`).
    #[diesel(sql_type = Text)]
    pub status: String,
    /// Executions of the tool so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
}

/// One transition.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HistoryEntry {
    /// The state entered.
    pub state: JobState,
    /// When it was entered.
    pub at: DateTime<Utc>,
    /// The attempt that made it (0 at intake; the job's count for an operator's).
    pub attempt: i32,
    /// The node that made it, `intake`, or the operator who asked.
    pub worker: String,
    /// Who asked and why, for an operator's transition (redrive, cancel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The completion webhook's outbox row.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DeliveryView {
    /// The webhook's key (`job:{id}:completed`), sent as `Idempotency-Key` and `webhook-id`.
    pub idempotency_key: String,
    /// `claimed`, `delivered`, `unknown` or `dead`.
    pub status: String,
    /// Sends of the webhook so far.
    pub attempts: i32,
    /// The HTTP status of the last send, if it got an answer.
    pub last_status: Option<i32>,
    /// The last failed send's error envelope, if any.
    pub last_error: Option<ErrorEnvelope>,
    /// When the consumer answered 2xx.
    pub delivered_at: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct JobRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    workflow: String,
    #[diesel(sql_type = Integer)]
    workflow_version: i32,
    #[diesel(sql_type = Integer)]
    priority: i32,
    #[diesel(sql_type = Timestamptz)]
    run_at: DateTime<Utc>,
    #[diesel(sql_type = Jsonb)]
    request: Value,
    #[diesel(sql_type = Text)]
    request_hash: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    incarnation: i32,
    #[diesel(sql_type = Nullable<BigInt>)]
    owner_token: Option<i64>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    last_error: Option<Value>,
    #[diesel(sql_type = Nullable<Text>)]
    dead_reason: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    updated_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    finished_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    result: Option<Value>,
    #[diesel(sql_type = Nullable<Text>)]
    trace_context: Option<String>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    waiting: Option<Value>,
    #[diesel(sql_type = Nullable<Text>)]
    parent_id: Option<String>,
}

#[derive(QueryableByName)]
struct HistoryRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Timestamptz)]
    at: DateTime<Utc>,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    worker: String,
    #[diesel(sql_type = Nullable<Text>)]
    note: Option<String>,
}

#[derive(QueryableByName)]
struct OutboxRow {
    #[diesel(sql_type = Text)]
    idempotency_key: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Integer>)]
    last_status: Option<i32>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    last_error: Option<Value>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    delivered_at: Option<DateTime<Utc>>,
}

/// What job `j` waits for now: its durable wait, or — due, unleased, with
/// every slot of its concurrency key held — `{"kind": "concurrency",
/// "key"}`, or — never started, every start slot of its throttled key
/// taken in the last period — `{"kind": "throttle", "key", "until"}`
/// (read, never stored: it ends the moment a slot frees).
macro_rules! waiting_now {
    () => {
        "CASE WHEN j.finished_at IS NOT NULL THEN NULL \
              WHEN j.waiting IS NOT NULL THEN j.waiting \
              WHEN j.concurrency_key IS NOT NULL AND j.key_slot IS NULL AND j.run_at <= now() \
                AND (j.lease_owner IS NULL OR j.lease_expires_at < now()) \
                AND (SELECT count(*) FROM jobs k WHERE k.tenant = j.tenant \
                       AND k.concurrency_key = j.concurrency_key AND k.key_slot IS NOT NULL) \
                    >= coalesce(j.concurrency_limit, 1) \
              THEN jsonb_build_object('kind', 'concurrency', 'key', j.concurrency_key) \
              WHEN j.throttle_limit IS NOT NULL AND j.throttle_slot IS NULL AND j.run_at <= now() \
                AND NOT EXISTS (SELECT 1 FROM throttle_free_slots(j.tenant, j.concurrency_key, \
                                    j.throttle_limit, j.throttle_period_s)) \
              THEN jsonb_build_object('kind', 'throttle', 'key', j.concurrency_key, 'until', \
                  to_char(throttle_next_free(j.tenant, j.concurrency_key, j.throttle_limit, \
                                             j.throttle_period_s) AT TIME ZONE 'UTC', \
                          'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')) END"
    };
}

/// The kinds of wait that are read, never stored (a key's slots): listed
/// by computing each keyed live job's wait.
pub const COMPUTED_WAIT_KINDS: [&str; 2] = ["concurrency", "throttle"];

const SELECT_JOB: &str = concat!("SELECT j.id, j.workflow, j.workflow_version, j.priority, j.run_at, j.request, j.request_hash, j.state::text AS state, \
     j.attempts, j.incarnation, j.owner_token, j.last_error, j.dead_reason, j.created_at, j.updated_at, j.finished_at, r.output AS result, j.trace_context, ",
     waiting_now!(), " AS waiting, j.parent_id \
     FROM jobs j LEFT JOIN results r ON r.job_id = j.id WHERE j.id = $1");

impl Jobs<'_> {
    /// Records a new job in `received` with its first history row, or reports
    /// what is already stored under that id. Race-safe: the primary key
    /// decides, and a losing concurrent insert waits for the winner to commit.
    ///
    /// The job's attempts and outgoing requests continue the submission's
    /// trace (stored with a new job; an existing job keeps its own), and it
    /// belongs to its `owner`. A new job due now is handed to
    /// `hand_to`, the node that reserved room for it: it is inserted
    /// leased to that node in the same commit, and the lease is returned
    /// for the node to adopt (see [`crate::node::handoff`]); a job that exists
    /// already, is scheduled for later, or has a concurrency key is not.
    pub async fn submit(self, submission: &Submission<'_>) -> Result<Submitted, StoreError> {
        let (job, trace, owner) = (submission.job, submission.trace, submission.owner);
        let new = submission.row();
        let handed = new.lease.is_some();
        let hand_to = submission.hand_to.clone().filter(|_| handed);
        let request = job.request();
        let hash = new.request_hash.clone();
        let inserted = self.batches.intake.call(new).await?;
        if let Some(row) = inserted {
            let leased = hand_to.filter(|_| row.leased).map(|hand_to| Leased {
                fence: super::Fence {
                    job_id: job.id.clone(),
                    incarnation: row.incarnation,
                    epoch: row.lease_epoch,
                    attempt: row.attempts,
                    worker: hand_to.node,
                },
                workflow: job.workflow.clone(),
                workflow_version: job.workflow_version,
                request,
                state: JobState::Received,
                previous_owner: None,
                trace: Some(trace),
                store_failures: 0,
                owner_token: owner,
                // A handed-off job is never keyed (intake hands off none).
                throttle_frees_in: None,
            });
            let created = Intake::Created(JobView {
                id: job.id.clone(),
                workflow: job.workflow.clone(),
                workflow_version: job.workflow_version,
                priority: job.schedule.priority,
                run_at: row.run_at,
                state: JobState::Received,
                attempts: row.attempts,
                incarnation: row.incarnation,
                input: job.input.clone(),
                webhook_url: job.webhook_url.clone(),
                tags: job.tags.clone(),
                concurrency_key: job.schedule.concurrency_key.clone(),
                result: None,
                history: vec![HistoryEntry {
                    state: JobState::Received,
                    at: row.at,
                    attempt: 0,
                    worker: INTAKE_WORKER.to_owned(),
                    note: None,
                }],
                delivery: None,
                last_error: None,
                dead_reason: None,
                created_at: row.created_at,
                updated_at: row.created_at,
                finished_at: None,
                trace_id: Some(trace.trace_id_hex()),
                owner_token: owner,
                model_calls: Vec::new(),
                tool_calls: Vec::new(),
                waiting: None,
                signals: Vec::new(),
                parent: None,
                children: Vec::new(),
            });
            return Ok(Submitted {
                intake: created,
                leased,
            });
        }
        let mut conn = self.db.conn().await?;
        let Some((view, stored_hash)) = self.load_view(&mut conn, &job.id).await? else {
            // Not inserted and not there: intake's statement left it out,
            // its token's backlog being full.
            return match submission.backlog_limit.filter(|_| owner.is_some()) {
                Some(limit) => Ok(Submitted {
                    intake: Intake::BacklogFull(limit),
                    leased: None,
                }),
                None => Err(StoreError::Query(diesel::result::Error::NotFound)),
            };
        };
        let intake = if stored_hash == hash {
            Intake::Existing(view)
        } else {
            Intake::Conflict(view)
        };
        Ok(Submitted {
            intake,
            leased: None,
        })
    }

    /// The job with its history and delivery, or `None`.
    pub async fn get(self, id: &str) -> Result<Option<JobView>, StoreError> {
        let mut conn = self.db.conn().await?;
        Ok(self.load_view(&mut conn, id).await?.map(|(view, _)| view))
    }

    async fn load_view(
        self,
        conn: &mut diesel_async::AsyncPgConnection,
        id: &str,
    ) -> Result<Option<(JobView, String)>, StoreError> {
        let Some(row) = sql(SELECT_JOB)
            .bind::<Text, _>(id)
            .get_result::<JobRow>(conn)
            .await
            .map(Some)
            .or_else(not_found_is_none)?
        else {
            return Ok(None);
        };
        let history = sql(
            "SELECT state::text AS state, at, attempt, worker, note FROM job_history WHERE job_id = $1 ORDER BY id",
        )
        .bind::<Text, _>(id)
        .load::<HistoryRow>(conn)
        .await?
        .into_iter()
        .map(|h| {
            Ok(HistoryEntry {
                state: parse_state(&h.state)?,
                at: h.at,
                attempt: h.attempt,
                worker: h.worker,
                note: h.note,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
        let delivery = sql(
            "SELECT idempotency_key, status::text AS status, attempts, last_status, last_error, delivered_at \
             FROM outbox WHERE job_id = $1 AND event = 'job.completed'",
        )
        .bind::<Text, _>(id)
        .get_result::<OutboxRow>(conn)
        .await
        .map(Some)
        .or_else(not_found_is_none)?
        .map(|o| DeliveryView {
            idempotency_key: o.idempotency_key,
            status: o.status,
            attempts: o.attempts,
            last_status: o.last_status,
            last_error: o.last_error.and_then(|e| serde_json::from_value(e).ok()),
            delivered_at: o.delivered_at,
        });
        let model_calls: Vec<ModelCallView> = sql(
            "SELECT idempotency_key, status::text AS status, attempts, input_tokens, output_tokens, last_error \
             FROM model_calls WHERE job_id = $1 ORDER BY id",
        )
        .bind::<Text, _>(id)
        .load(conn)
        .await?;
        let tool_calls: Vec<ToolCallView> = sql(
            "SELECT turn, call_index AS index, tool_name, tool_call_id, status::text AS status, attempts \
             FROM tool_calls WHERE job_id = $1 ORDER BY turn, call_index",
        )
        .bind::<Text, _>(id)
        .load(conn)
        .await?;
        let signals: Vec<super::waits::SignalView> = sql(
            "SELECT name, signal_id AS id, payload, received_at, taken_by FROM signals \
             WHERE job_id = $1 ORDER BY seq",
        )
        .bind::<Text, _>(id)
        .load(conn)
        .await?;
        let children: Vec<ChildView> = sql("SELECT id, workflow, state::text AS state FROM jobs \
             WHERE parent_id = $1 AND parent_incarnation = $2 \
             ORDER BY created_at, id LIMIT 1000")
        .bind::<Text, _>(id)
        .bind::<diesel::sql_types::Integer, _>(row.incarnation)
        .load(conn)
        .await?;
        let request = JobRequest::from_stored(row.request);
        let view = JobView {
            parent: row.parent_id,
            children,
            model_calls,
            tool_calls,
            signals,
            waiting: row.waiting,
            state: parse_state(&row.state)?,
            id: row.id,
            workflow: row.workflow,
            workflow_version: row.workflow_version,
            priority: row.priority,
            run_at: row.run_at,
            attempts: row.attempts,
            incarnation: row.incarnation,
            input: request.input,
            webhook_url: request.webhook_url,
            tags: request.tags,
            concurrency_key: request.concurrency_key,
            result: row.result,
            history,
            delivery,
            last_error: row.last_error.and_then(|e| serde_json::from_value(e).ok()),
            dead_reason: row.dead_reason,
            created_at: row.created_at,
            updated_at: row.updated_at,
            finished_at: row.finished_at,
            trace_id: row
                .trace_context
                .as_deref()
                .and_then(TraceParent::parse)
                .map(|t| t.trace_id_hex()),
            owner_token: row.owner_token,
        };
        Ok(Some((view, row.request_hash)))
    }
}

pub(crate) fn not_found_is_none<T>(
    e: diesel::result::Error,
) -> Result<Option<T>, diesel::result::Error> {
    match e {
        diesel::result::Error::NotFound => Ok(None),
        other => Err(other),
    }
}

/// One job in a list: what an operator scans for, not the whole record.
#[derive(Debug, Clone, Serialize, QueryableByName, utoipa::ToSchema)]
pub struct JobSummary {
    /// The job id.
    #[diesel(sql_type = Text)]
    pub id: String,
    /// The name of the workflow it runs.
    #[diesel(sql_type = Text)]
    pub workflow: String,
    /// The version of the workflow it started on (and runs on).
    #[diesel(sql_type = Integer)]
    pub workflow_version: i32,
    /// Its lifecycle state, as stored (`received`, …, `acked`, `dead`, `cancelled`).
    #[diesel(sql_type = Text)]
    pub state: String,
    /// Attempts started so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// Which life of the id this is (1 unless purged and submitted again).
    #[diesel(sql_type = Integer)]
    pub incarnation: i32,
    /// When the job was submitted.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// When the job row last changed.
    #[diesel(sql_type = Timestamptz)]
    pub updated_at: DateTime<Utc>,
    /// When the job reached a final state.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub finished_at: Option<DateTime<Utc>>,
    /// Why the job is dead, if it is.
    #[diesel(sql_type = Nullable<Text>)]
    pub dead_reason: Option<String>,
    /// What the job waits for, or `null`.
    #[diesel(sql_type = Nullable<Jsonb>)]
    #[schema(value_type = Option<crate::rules::wait_machine::Waiting>)]
    pub waiting: Option<Value>,
    /// Its tags (label → value).
    #[diesel(sql_type = Jsonb)]
    #[schema(value_type = Object)]
    pub tags: Value,
    /// The name of the token that submitted it (its tenant), or `null`
    /// (development mode, a schedule of no token's).
    #[diesel(sql_type = Nullable<Text>)]
    pub token: Option<String>,
}

/// Which jobs to list.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only jobs of this workflow.
    pub workflow: Option<String>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Only this token's jobs (`None`: everyone's).
    pub owner: Option<i64>,
    /// Strictly older than this (created_at, id): the keyset cursor.
    pub before: Option<(DateTime<Utc>, String)>,
    /// Only jobs that wait (`Some(true)`), or only those that do not.
    pub waiting: Option<bool>,
    /// Only jobs waiting for this kind of thing (`sleep`, `signal`,
    /// `approval`, `children`).
    pub waiting_kind: Option<String>,
    /// Only jobs with this tag (label, value).
    pub tag: Option<(String, String)>,
    /// The most jobs returned in one page.
    pub limit: i64,
}

impl Jobs<'_> {
    /// Jobs newest first by (created_at, id), at most `filter.limit`, and
    /// whether more follow. Keyset-paginated: a page continues strictly
    /// after the last row of the previous one, so jobs submitted meanwhile
    /// (newer) never shift or repeat a page.
    pub async fn list(self, filter: &ListFilter) -> Result<(Vec<JobSummary>, bool), StoreError> {
        let mut conn = self.db.conn().await?;
        let (before_at, before_id) = match &filter.before {
            Some((at, id)) => (Some(*at), Some(id.as_str())),
            None => (None, None),
        };
        // One statement per shape: with a kind of wait named, the kind is a
        // plain condition, so `jobs_waiting_kind` serves it in any plan
        // (a `$9 IS NULL OR …` would keep a generic plan from the index).
        macro_rules! list {
            ($($waiting_kind:tt)*) => {
                concat!(
                    "SELECT id, workflow, workflow_version, state::text AS state, attempts, incarnation, created_at, \
                         updated_at, finished_at, dead_reason, ",
                    waiting_now!(),
                    " AS waiting, \
                         coalesce(request->'tags', '{}'::jsonb) AS tags, \
                         (SELECT t.name FROM api_tokens t WHERE t.id = j.owner_token) AS token \
                     FROM jobs j \
                     WHERE ($1::text IS NULL OR state::text = $1) \
                       AND ($2::text IS NULL OR workflow = $2) \
                       AND ($3::timestamptz IS NULL OR created_at >= $3) \
                       AND ($4::bigint IS NULL OR owner_token = $4) \
                       AND ($5::timestamptz IS NULL OR (created_at, id) < ($5, $6::text)) \
                       AND ($8::boolean IS NULL OR (waiting IS NOT NULL AND finished_at IS NULL) = $8) \
                       AND ($10::jsonb IS NULL OR (request ? 'tags' AND request->'tags' @> $10)) \
                       AND ",
                    $($waiting_kind)*,
                    " ORDER BY created_at DESC, id DESC \
                     LIMIT $7"
                )
            };
        }
        let computed = filter
            .waiting_kind
            .as_deref()
            .is_some_and(|k| COMPUTED_WAIT_KINDS.contains(&k));
        let text = if computed {
            // Read, never stored: only keyed live jobs can wait so.
            list!(
                "concurrency_key IS NOT NULL AND finished_at IS NULL AND (",
                waiting_now!(),
                ")->>'kind' = $9"
            )
        } else if filter.waiting_kind.is_some() {
            list!("waiting IS NOT NULL AND finished_at IS NULL AND waiting->>'kind' = $9")
        } else {
            list!("$9::text IS NULL")
        };
        let mut rows: Vec<JobSummary> = sql(text)
            .bind::<Nullable<Text>, _>(filter.state.map(JobState::as_str))
            .bind::<Nullable<Text>, _>(filter.workflow.as_deref())
            .bind::<Nullable<Timestamptz>, _>(filter.since)
            .bind::<Nullable<BigInt>, _>(filter.owner)
            .bind::<Nullable<Timestamptz>, _>(before_at)
            .bind::<Nullable<Text>, _>(before_id)
            .bind::<BigInt, _>(filter.limit + 1)
            .bind::<Nullable<diesel::sql_types::Bool>, _>(filter.waiting)
            .bind::<Nullable<Text>, _>(filter.waiting_kind.as_deref())
            .bind::<Nullable<Jsonb>, _>(
                filter
                    .tag
                    .as_ref()
                    .map(|(k, v)| serde_json::json!({ k: v })),
            )
            .load(&mut conn)
            .await?;
        let more = rows.len() as i64 > filter.limit;
        rows.truncate(filter.limit.max(0) as usize);
        Ok((rows, more))
    }

    /// Jobs per state (every state, zeros included), of `owner` or of all.
    pub async fn stats(self, owner: Option<i64>) -> Result<Vec<(JobState, u64)>, StoreError> {
        let mut conn = self.db.conn().await?;
        let rows: Vec<StateCount> = sql("SELECT state::text AS state, count(*) AS n FROM jobs \
             WHERE ($1::bigint IS NULL OR owner_token = $1) GROUP BY state")
        .bind::<Nullable<BigInt>, _>(owner)
        .load(&mut conn)
        .await?;
        per_state(JobState::ALL, rows)
    }
}

/// One row of a count of jobs by state.
#[derive(QueryableByName)]
pub(crate) struct StateCount {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The counts of `rows` for each of `states`, in that order, zeros included
/// (a counted state not among `states` is left out).
pub(crate) fn per_state(
    states: impl IntoIterator<Item = JobState>,
    rows: Vec<StateCount>,
) -> Result<Vec<(JobState, u64)>, StoreError> {
    let mut counts: Vec<(JobState, u64)> = states.into_iter().map(|s| (s, 0)).collect();
    for r in rows {
        let state = parse_state(&r.state)?;
        if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == state) {
            slot.1 = r.n.max(0) as u64;
        }
    }
    Ok(counts)
}
