//! The job actor: one actix actor per running job attempt.
//!
//! It drives the lifecycle from the job's last checkpoint: decide the next
//! step with [`next_step`] (pure), carry it out, commit the checkpoint, repeat.
//! Every write is fenced by the lease epoch; a lost lease stops it with no
//! further side effects. It reports how the attempt ended to its supervisor.

use std::sync::Arc;

use actix::prelude::*;
use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::Value;

use crate::attempt_spans::Scope;
use crate::context::Context;
use crate::error::StepError;
use crate::faults::{FailPoint, Injected};
use crate::net::outbound::PostError;
use crate::net::webhook;
use crate::node::shared::Shared;
use crate::rules::keys;
use crate::rules::lifecycle::{next_step, JobState, Step};
use crate::rules::retry::RetryPolicy;
use crate::rules::verdict::{on_failure, on_send_failure, OutboxStatus, SendFailure, Verdict};
use crate::store::journal::{Claim, DeliveryStart, FailedSend, KillWith};
use crate::store::{Checkpoint, Fence, Leased};
use crate::workflow::{DeliveryPolicy, DynWorkflow};

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The job is acked.
    Acked,
    /// The job is dead-lettered.
    Dead,
    /// A transient failure; the job runs again later.
    Rescheduled,
    /// Another attempt owns the job; nothing more was written.
    LeaseLost,
    /// A failpoint crashed the attempt; the lease expires and the supervisor resumes it.
    Crashed,
    /// The database failed while settling the attempt; the lease expires and it is resumed.
    Abandoned(String),
    /// The node is draining: the attempt stopped at a step boundary, with
    /// everything it did recorded; the engine releases the lease.
    Drained,
    /// The body reached a wait that is not over: the job was released until
    /// it is due, in the wait's own commit.
    Waiting {
        /// When the wait is due by the database's clock, on this process's
        /// monotonic clock (`None`: beyond it); the supervisor polls then.
        due: Option<std::time::Instant>,
    },
}

// ---- messages ---------------------------------------------------------------

/// Stop at once: the lease is lost or the node is shutting down.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Abort;

/// An attempt ended (sent to the supervisor).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Finished {
    /// The job the attempt ran.
    pub job_id: String,
    /// The lease epoch the attempt held (its fence).
    pub epoch: i64,
    /// How the attempt ended.
    pub outcome: Outcome,
}

// ---- the actor --------------------------------------------------------------

/// One job attempt.
pub struct JobActor {
    run: Option<JobRun>,
    supervisor: Recipient<Finished>,
}

impl JobActor {
    pub(crate) fn new(run: JobRun, supervisor: Recipient<Finished>) -> Self {
        JobActor {
            run: Some(run),
            supervisor,
        }
    }
}

impl Actor for JobActor {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let run = self.run.take().expect("a job actor starts once");
        let (job_id, epoch) = (run.fence.job_id.clone(), run.fence.epoch);
        ctx.spawn(
            run.execute()
                .into_actor(self)
                .map(move |outcome, act, ctx| {
                    act.supervisor.do_send(Finished {
                        job_id,
                        epoch,
                        outcome,
                    });
                    ctx.stop();
                }),
        );
    }
}

impl Handler<Abort> for JobActor {
    type Result = ();
    fn handle(&mut self, _: Abort, ctx: &mut Self::Context) {
        // Dropping the spawned run cancels it at its current await point.
        ctx.stop();
    }
}

// ---- the run ----------------------------------------------------------------

/// One attempt's work, independent of the actor that hosts it.
pub(crate) struct JobRun {
    fence: Fence,
    state: JobState,
    input: Value,
    webhook_url: String,
    workflow: Arc<dyn DynWorkflow>,
    ctx: Context,
    shared: Arc<Shared>,
    /// The job's earlier attempts that ended on a database error.
    store_failures: u32,
    /// The API token that submitted the job (its webhooks' signing secret).
    owner_token: Option<i64>,
    /// Set when this attempt claimed the completion event itself: the outbox
    /// row was born with send 1 in flight for us (url, body), and the lease
    /// runs for at least `lease` from the instant given (taken before the
    /// commit was sent).
    first_send: Option<(String, Value, std::time::Instant)>,
}

impl JobRun {
    pub(crate) fn new(leased: Leased, workflow: Arc<dyn DynWorkflow>, shared: Arc<Shared>) -> Self {
        // This attempt is a span of its own in the job's trace.
        let scope = Scope::job(
            shared.config.telemetry.clone(),
            leased.trace,
            vec![
                KeyValue::new(JOB_ID, leased.fence.job_id.clone()),
                KeyValue::new(WORKFLOW_NAME, leased.workflow.clone()),
                KeyValue::new(JOB_ATTEMPT, i64::from(leased.fence.attempt)),
                KeyValue::new(LEASE_EPOCH, leased.fence.epoch),
            ],
        );
        let ctx = Context {
            fence: leased.fence.clone(),
            store: shared.store.clone(),
            provider: shared.provider.clone(),
            faults: shared.faults.clone(),
            wait_poll: shared.config.wait_poll,
            client: shared.client.clone(),
            draining: shared.draining.clone(),
            tool_timeout: shared.config.webhook_timeout,
            tool_events: false,
            guard: shared.config.url_guard.clone(),
            tool_response_limit: shared.config.tool_response_limit,
            replay: crate::context::Replay::for_attempt(leased.fence.attempt),
            limiter: shared.limiter.clone(),
            priority: leased.request.priority,
            signal_waits: Default::default(),
            joins: 0,
            children: shared.child_rules.clone(),
            owner_token: leased.owner_token,
            hub: shared.hub.clone(),
            scope,
        };
        let request = leased.request;
        JobRun {
            webhook_url: request.webhook_url,
            input: request.input,
            fence: leased.fence,
            state: leased.state,
            store_failures: u32::try_from(leased.store_failures).unwrap_or(0),
            owner_token: leased.owner_token,
            workflow,
            ctx,
            shared,
            first_send: None,
        }
    }

    /// Runs the attempt to its end and settles any failure.
    pub(crate) async fn execute(mut self) -> Outcome {
        // The steps in `drive` that are not where a job waits long (commit,
        // delivery, ack) and `settle` are boxed, so the future every
        // in-flight job keeps is only as large as the step it waits in
        // (with the boxed journal writes in `Context`: 266 → 243 MiB at
        // 10,000 in flight, `bench --hold`).
        let outcome = match self.drive().await {
            Ok(outcome) => outcome,
            Err(e) => Box::pin(self.settle(e)).await,
        };
        let (name, error) = match &outcome {
            Outcome::Acked => ("acked", false),
            Outcome::Dead => ("dead", true),
            Outcome::Rescheduled => ("rescheduled", false),
            Outcome::LeaseLost => ("lease_lost", false),
            Outcome::Crashed => ("crashed", true),
            Outcome::Abandoned(_) => ("abandoned", true),
            Outcome::Drained => ("drained", false),
            Outcome::Waiting { .. } => ("waiting", false),
        };
        self.ctx.scope.end_job(name, error);
        outcome
    }

    async fn drive(&mut self) -> Result<Outcome, StepError> {
        let faults = self.shared.faults.clone();
        loop {
            // A drain lets the step in progress finish and record itself,
            // and starts nothing new.
            if self.shared.is_draining() && !self.state.is_terminal() {
                return Err(StepError::Draining);
            }
            let reached = match next_step(self.state) {
                Step::RunBody | Step::Persist => {
                    // From `generated` the body replays from the journal: no
                    // model call is repeated.
                    let output = self.workflow.run(&mut self.ctx, &self.input).await?;
                    Box::pin(self.commit_result(&output)).await?
                }
                Step::Claim => {
                    let output =
                        Box::pin(self.shared.store.journal().result_of(&self.fence.job_id))
                            .await?
                            .ok_or_else(|| {
                                StepError::permanent(
                                    "missing_result",
                                    "persisted without a result row",
                                    "schema invariant broken",
                                )
                            })?;
                    Box::pin(self.commit_result(&output)).await?
                }
                Step::Deliver => Box::pin(self.deliver()).await?,
                Step::Ack => Box::pin(self.ack_found()).await?,
                Step::Done => {
                    return Ok(match self.state {
                        JobState::Dead => Outcome::Dead,
                        JobState::Cancelled => Outcome::LeaseLost,
                        _ => Outcome::Acked,
                    })
                }
            };
            tracing::debug!(job.id = %self.fence.job_id, from = %self.state, to = %reached, "checkpoint");
            // One commit may have passed several states; each boundary is a seam.
            let passed: Vec<JobState> = if reached == JobState::Dead {
                vec![JobState::Dead]
            } else {
                JobState::ALL
                    .into_iter()
                    .filter(|s| *s > self.state && *s <= reached)
                    .collect()
            };
            self.state = reached;
            for state in passed {
                Box::pin(faults.hit(&self.fence.job_id, FailPoint::AfterCommit(state.as_str())))
                    .await?;
            }
        }
    }

    /// Acks a job found at `delivered`: recorded by a version that
    /// committed the delivery and the ack apart. Today's delivery commits
    /// both at once.
    async fn ack_found(&mut self) -> Result<JobState, StepError> {
        let span = self.ctx.scope.step(
            SPAN_ACK,
            SpanKind::Internal,
            vec![KeyValue::new(TRANSITION, "delivered->acked")],
        );
        self.shared
            .faults
            .hit(&self.fence.job_id, FailPoint::Ack)
            .await?;
        let c = self.shared.store.journal().ack(&self.fence).await?;
        span.end(checkpoint_outcome(c));
        self.settled(c, JobState::Acked, "acked")
    }

    /// Commits the output and claims the completion webhook (through `claimed`).
    async fn commit_result(&mut self, output: &Value) -> Result<JobState, StepError> {
        let body = crate::rules::event::completed(&self.fence.job_id, output, chrono::Utc::now());
        let key = keys::completed(&self.fence.key());
        let at_least_once = self.workflow.delivery_policy() == DeliveryPolicy::AtLeastOnce;
        let claim = Claim {
            event: keys::COMPLETED_EVENT,
            key: &key,
            url: &self.webhook_url,
            body: &body,
            in_flight_ms: at_least_once.then(|| self.delivery_in_flight_ms()),
            lease_ms: at_least_once.then(|| self.shared.config.lease.as_millis() as i64),
        };
        // One commit: `persist` (when the output is new) and `claim` spans
        // cover the same statement.
        let shared_commit = self.state < JobState::Persisted;
        let persist = shared_commit.then(|| {
            self.ctx.scope.step(
                SPAN_PERSIST,
                SpanKind::Internal,
                vec![
                    KeyValue::new(TRANSITION, format!("{}->persisted", self.state)),
                    KeyValue::new(SHARED_COMMIT, true),
                ],
            )
        });
        let claim_span = self.ctx.scope.step(
            SPAN_CLAIM,
            SpanKind::Internal,
            vec![
                KeyValue::new(TRANSITION, "persisted->claimed"),
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
                KeyValue::new(SHARED_COMMIT, shared_commit),
            ],
        );
        let committing = std::time::Instant::now();
        let c = self
            .shared
            .store
            .journal()
            .commit_result(&self.fence, self.state, output, &claim, &self.shared.faults)
            .await?;
        if let Some(span) = persist {
            span.end(checkpoint_outcome(c));
        }
        claim_span.end(checkpoint_outcome(c));
        if c == Checkpoint::Moved && at_least_once {
            self.first_send = Some((self.webhook_url.clone(), body, committing));
        }
        self.settled(c, JobState::Claimed, "claimed")
    }

    fn delivery_in_flight_ms(&self) -> i64 {
        (self.shared.config.webhook_timeout + std::time::Duration::from_secs(5)).as_millis() as i64
    }

    /// POSTs the completion webhook until it is delivered, retried later or dead.
    async fn deliver(&mut self) -> Result<JobState, StepError> {
        let store = &self.shared.store;
        let config = &self.shared.config;
        let key = keys::completed(&self.fence.key());
        let at_most_once = self.workflow.delivery_policy() == DeliveryPolicy::AtMostOnce;
        let in_flight_ms = self.delivery_in_flight_ms();
        let metrics = self.ctx.scope.metrics().clone();
        // Read before any send is marked begun: a failure here leaves no
        // send marked that was never made.
        if self.webhook_url.is_empty() {
            // A job given no webhook (submitted without one, or a child):
            // delivered means recorded, with no send (the outbox row has no
            // URL and status 0).
            self.first_send = None;
            let c = store
                .journal()
                .mark_delivered(&self.fence, &key, 0, &self.shared.faults)
                .await?;
            return self.settled(c, JobState::Acked, "delivered");
        }
        let secret = self.shared.signing_secret(self.owner_token).await?;
        let step = |send: Option<i32>| {
            let mut attrs = vec![
                KeyValue::new(TRANSITION, "claimed->delivered"),
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
            ];
            if let Some(send) = send {
                attrs.push(KeyValue::new("onceflow.send", i64::from(send)));
            }
            self.ctx.scope.step(SPAN_DELIVER, SpanKind::Client, attrs)
        };
        loop {
            if self.shared.is_draining() {
                return Err(StepError::Draining);
            }
            let start = match self.first_send.take() {
                // We claimed the event in this attempt: send 1 is ours
                // already. While the lease the commit extended has at least
                // half to run, no takeover can have happened; later (the
                // attempt was paused or slow), the fence is read first.
                Some((url, body, committing)) => {
                    if committing.elapsed() >= self.shared.config.lease / 2
                        && !store.leases().holds(&self.fence).await?
                    {
                        return Err(StepError::LeaseLost);
                    }
                    DeliveryStart::Send {
                        attempt: 1,
                        url,
                        body,
                    }
                }
                None => {
                    store
                        .journal()
                        .begin_delivery(&self.fence, &key, at_most_once, in_flight_ms)
                        .await?
                }
            };
            match start {
                DeliveryStart::Delivered => {
                    // The journal shows it delivered: no send.
                    metrics.delivery(OUTCOME_DUPLICATE_SUPPRESSED);
                    step(None).end(OUTCOME_SUPPRESSED);
                    return self.current_state().await;
                }
                DeliveryStart::Closed(_) => {
                    // The row was closed; `begin_delivery` closed the job with it.
                    step(None).end(OUTCOME_SUPPRESSED);
                    return self.current_state().await;
                }
                DeliveryStart::LeaseLost => return Err(StepError::LeaseLost),
                DeliveryStart::InFlight { .. } => tokio::time::sleep(config.wait_poll).await,
                DeliveryStart::Unknown => {
                    // The row is `unknown` and the job `dead`, one commit.
                    metrics.delivery(OUTCOME_DEAD);
                    step(None).end(OUTCOME_FAILED);
                    return self.settled(Checkpoint::Moved, JobState::Dead, "dead");
                }
                DeliveryStart::Send { attempt, url, body } => {
                    let span = step(Some(attempt));
                    return self
                        .send_webhook(&key, attempt, &url, &body, secret.as_deref(), span)
                        .await;
                }
            }
        }
    }

    /// Sends the completion webhook (send `attempt` under `key`), then
    /// records what came of it: delivered and acked in one commit; or the
    /// failure, with the job's death when its delivery policy says the
    /// delivery is over (one transaction), else a retry.
    async fn send_webhook(
        &self,
        key: &str,
        attempt: i32,
        url: &str,
        body: &Value,
        secret: Option<&webhook::WebhookSecret>,
        mut span: crate::attempt_spans::StepSpan,
    ) -> Result<JobState, StepError> {
        let store = &self.shared.store;
        let config = &self.shared.config;
        let metrics = self.ctx.scope.metrics().clone();
        let sender = webhook::Sender {
            client: &self.shared.client,
            guard: &config.url_guard,
            secret,
            timeout: config.webhook_timeout,
        };
        let sent = webhook::send(
            sender,
            url,
            key,
            body,
            &span.traceparent(),
            &self.shared.faults,
            &self.fence.job_id,
        )
        .await;
        let failure = match sent {
            Ok(status) => {
                span.set(KeyValue::new(HTTP_STATUS, i64::from(status)));
                // One commit records the delivery and the ack.
                let ack = self.ctx.scope.step(
                    SPAN_ACK,
                    SpanKind::Internal,
                    vec![
                        KeyValue::new(TRANSITION, "delivered->acked"),
                        KeyValue::new(SHARED_COMMIT, true),
                    ],
                );
                let c = store
                    .journal()
                    .mark_delivered(&self.fence, key, i32::from(status), &self.shared.faults)
                    .await?;
                if c == Checkpoint::Moved {
                    metrics.delivery(OUTCOME_DELIVERED);
                }
                span.end(checkpoint_outcome(c));
                ack.end(checkpoint_outcome(c));
                return self.settled(c, JobState::Acked, "delivered");
            }
            Err(PostError::Injected(i)) => {
                // A failpoint after the send: to the engine, a lost answer.
                if matches!(i, Injected::Fail(_)) {
                    metrics.delivery(OUTCOME_RETRIED);
                    span.end(OUTCOME_RETRIED);
                }
                return Err(i.into());
            }
            Err(PostError::Failed(f)) => f,
        };
        let error = failure.envelope();
        if let Some(status) = failure.status() {
            span.set(KeyValue::new(HTTP_STATUS, i64::from(status)));
        }
        span.set(KeyValue::new(ERROR_CODE, error.code.clone()));
        let sends = attempt.max(1) as u32;
        let verdict = on_send_failure(
            self.workflow.delivery_policy(),
            SendFailure {
                may_have_arrived: !failure.never_sent(),
                retryable: failure.is_retryable(),
                sends,
            },
            &config.webhook_retry,
        );
        let closes = verdict.closes(&error.code, sends);
        metrics.delivery(if closes.is_some() {
            OUTCOME_DEAD
        } else {
            OUTCOME_RETRIED
        });
        span.end(if closes.is_some() {
            OUTCOME_FAILED
        } else {
            OUTCOME_RETRIED
        });
        // The failure's record and, when the job is over, its
        // death: one transaction, so no interleaving leaves a
        // row that looks unsent under a dead-end job.
        let kill = closes.as_ref().map(|(outbox_status, reason)| KillWith {
            reason,
            outbox_status: *outbox_status,
        });
        let c = store
            .journal()
            .fail_delivery(
                &self.fence,
                key,
                &FailedSend {
                    error: error.clone(),
                    status: failure.status().map(i32::from),
                },
                kill,
            )
            .await?;
        if kill.is_some() || c != Checkpoint::Moved {
            return self.settled(c, JobState::Dead, "dead");
        }
        Err(StepError::Retry {
            error,
            attempt: attempt.max(1) as u32,
            retry_after: failure.retry_after(),
        })
    }

    async fn current_state(&self) -> Result<JobState, StepError> {
        self.shared
            .store
            .jobs()
            .state_of(&self.fence.job_id)
            .await?
            .ok_or(StepError::LeaseLost)
    }

    /// Turns a failed step into the job's next durable state: the pure
    /// [`on_failure`] decides, this carries it out.
    async fn settle(&mut self, error: StepError) -> Outcome {
        let policy = self.policy();
        let job_id = self.fence.job_id.clone();
        let result = match on_failure(&error, self.state, &policy, self.store_failures) {
            Verdict::Stop => {
                return match &error {
                    StepError::Injected(Injected::Crash(point)) => {
                        tracing::info!(job.id = %job_id, %point, "attempt crashed (injected)");
                        Outcome::Crashed
                    }
                    StepError::Draining => Outcome::Drained,
                    StepError::Waiting {
                        kind,
                        name,
                        until,
                        due,
                    } => {
                        tracing::debug!(job.id = %job_id, kind, name, %until, "waiting");
                        Outcome::Waiting { due: *due }
                    }
                    _ => Outcome::LeaseLost,
                };
            }
            Verdict::Retry {
                attempt,
                retry_after,
            } => {
                self.reschedule(policy.delay(attempt, retry_after), &error)
                    .await
            }
            Verdict::Dead { reason } => self.kill(&reason, &error).await,
        };
        match result {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::error!(job.id = %job_id, error = %e, "could not settle the attempt; its lease will expire");
                Outcome::Abandoned(e.to_string())
            }
        }
    }

    fn policy(&self) -> RetryPolicy {
        match self.state {
            JobState::Claimed | JobState::Delivered => self.shared.config.webhook_retry,
            JobState::Received
            | JobState::Generated
            | JobState::Persisted
            | JobState::Acked
            | JobState::Dead
            | JobState::Cancelled => self.shared.config.model_retry,
        }
    }

    async fn reschedule(
        &self,
        delay: std::time::Duration,
        error: &StepError,
    ) -> Result<Outcome, StepError> {
        tracing::info!(job.id = %self.fence.job_id, state = %self.state, delay_ms = delay.as_millis() as u64, error = %error, "retrying later");
        Ok(
            match self
                .shared
                .store
                .leases()
                .reschedule(
                    &self.fence,
                    delay,
                    &error.envelope(),
                    matches!(error, StepError::Store(_)),
                )
                .await?
            {
                Checkpoint::Moved => Outcome::Rescheduled,
                Checkpoint::LeaseLost | Checkpoint::AlreadyAt(_) | Checkpoint::Faulted => {
                    Outcome::LeaseLost
                }
            },
        )
    }

    async fn kill(&self, reason: &str, error: &StepError) -> Result<Outcome, StepError> {
        tracing::warn!(job.id = %self.fence.job_id, state = %self.state, reason, error = %error, "job is dead");
        let key = keys::completed(&self.fence.key());
        let outbox =
            (self.state == JobState::Claimed).then_some((key.as_str(), OutboxStatus::Dead));
        Ok(
            match self
                .shared
                .store
                .journal()
                .kill(&self.fence, reason, &error.envelope(), outbox)
                .await?
            {
                Checkpoint::Moved => {
                    let metrics = self.ctx.scope.metrics();
                    metrics.transition(JobState::Dead.as_str());
                    if outbox.is_some() {
                        metrics.delivery(OUTCOME_DEAD);
                    }
                    Outcome::Dead
                }
                Checkpoint::LeaseLost | Checkpoint::AlreadyAt(_) | Checkpoint::Faulted => {
                    Outcome::LeaseLost
                }
            },
        )
    }
}

impl JobRun {
    /// Maps a checkpoint's outcome to the state the job is in now, counting
    /// the transitions this attempt committed.
    fn settled(
        &self,
        c: Checkpoint,
        to: JobState,
        name: &'static str,
    ) -> Result<JobState, StepError> {
        if c == Checkpoint::Moved {
            let metrics = self.ctx.scope.metrics();
            if to == JobState::Dead {
                metrics.transition(to.as_str());
            } else {
                JobState::ALL
                    .into_iter()
                    .filter(|s| *s > self.state && *s <= to)
                    .for_each(|s| metrics.transition(s.as_str()));
            }
        }
        settled(c, to, name)
    }
}

/// What a checkpoint's outcome means for its span.
fn checkpoint_outcome(c: Checkpoint) -> &'static str {
    match c {
        Checkpoint::Moved => OUTCOME_PERFORMED,
        Checkpoint::AlreadyAt(_) | Checkpoint::LeaseLost => OUTCOME_SUPPRESSED,
        Checkpoint::Faulted => OUTCOME_FAILED,
    }
}

/// Maps a checkpoint's outcome to the state the job is in now.
fn settled(c: Checkpoint, to: JobState, name: &'static str) -> Result<JobState, StepError> {
    match c {
        Checkpoint::Moved => Ok(to),
        Checkpoint::AlreadyAt(now) => Ok(now),
        Checkpoint::LeaseLost => Err(StepError::LeaseLost),
        Checkpoint::Faulted => Err(StepError::Injected(Injected::Crash(
            FailPoint::BeforeCommit(name),
        ))),
    }
}
