//! The durable context a workflow body runs through. Every side effect is
//! journaled under a key derived from the job and the step, and on a rerun
//! returns its journaled result instead of being done again.

use std::sync::Arc;
use std::time::Duration;

use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::Value;

use crate::attempt_spans::Scope;
use crate::error::{ErrorEnvelope, StepError};
use crate::faults::Faults;
use crate::keys;
use crate::outbound::PostError;
use crate::provider::{Provider, Usage};
use crate::quota::CallEnd;
use crate::request::canonical_hash;
use crate::store::journal::{FailedSend, ModelCallStart};
use crate::store::slots::{Admission, Ask};
use crate::store::streams::StreamRow;
use crate::store::{Checkpoint, Fence, Store};
use crate::verdict::{on_call_failure, on_tool_error};

/// Everything a step needs; built by the job actor for one attempt.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) fence: Fence,
    pub(crate) store: Store,
    pub(crate) provider: Arc<Provider>,
    pub(crate) faults: Faults,
    /// How often a step waiting on a concurrent attempt looks again.
    pub(crate) wait_poll: Duration,
    pub(crate) client: reqwest::Client,
    /// Set when the node drains: no new side effect starts.
    pub(crate) draining: Arc<std::sync::atomic::AtomicBool>,
    /// Timeout of a tool's own requests.
    pub(crate) tool_timeout: Duration,
    /// The SSRF guard for the URLs tools and steps post to.
    pub(crate) guard: crate::guard::UrlGuard,
    /// Largest tool or step answer read.
    pub(crate) tool_response_limit: usize,
    /// This attempt's `job` span and the node's instruments.
    pub(crate) scope: Scope,
    /// Whether this rerun still follows the job's journal.
    pub(crate) replay: Replay,
    /// Provider limits shared by every node.
    pub(crate) limiter: Arc<crate::limiter::Limiter>,
    /// The job's priority: it orders the calls waiting for a provider limit.
    pub(crate) priority: i32,
}

/// What a rerun of a body has asked of the job's journal so far (see
/// [`Context::follow_journal`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Replay {
    /// Whether to check: not on a first attempt (nothing is journaled yet),
    /// nor once the rerun has asked for every journaled key.
    armed: bool,
    /// The job's journaled keys, oldest first; read on first use.
    journal: Option<Vec<String>>,
    /// The keys this attempt asked for.
    asked: std::collections::HashSet<String>,
}

impl Replay {
    pub(crate) fn for_attempt(attempt: i32) -> Self {
        Replay {
            armed: attempt > 1,
            ..Replay::default()
        }
    }
}

/// Releases a provider slot whose call was dropped mid-way (the attempt
/// aborted, the lease lost, a panic): the release runs on its own task.
struct SlotGuard {
    store: Store,
    key: String,
    holder: String,
    cap: Option<u32>,
    armed: bool,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, key, holder, cap) = (
            self.store.clone(),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.holder),
            self.cap,
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = store
                    .end_call(&key, &holder, CallEnd::Other, cap, 0.0)
                    .await;
            });
        }
    }
}

/// How a model call was served, for callers that count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// This attempt sent the request.
    Performed,
    /// The journal already held the response.
    Replayed,
}

impl Context {
    /// `Err(Draining)` when the node drains: a side effect must not start.
    fn not_draining(&self) -> Result<(), StepError> {
        if self.draining.load(std::sync::atomic::Ordering::Acquire) {
            Err(StepError::Draining)
        } else {
            Ok(())
        }
    }

    /// Refuses a side effect whose `key` the journal lacks while a key the
    /// journal holds was never asked for by this rerun: the body no longer
    /// matches the job's journal (a changed body deployed under the same
    /// [`Workflow::VERSION`](crate::Workflow::VERSION)). Going on would call
    /// the model again for work already paid for, so the job fails,
    /// non-retryably, naming the step and the keys, and nothing is sent.
    ///
    /// A `ctx.step` is journaled only when its work succeeds (a body may go
    /// on past a failed one), so a step key the journal lacks is `optional`:
    /// it neither fails the check nor ends it.
    async fn follow_journal(
        &mut self,
        step: &str,
        key: &str,
        optional: bool,
    ) -> Result<(), StepError> {
        if !self.replay.armed {
            return Ok(());
        }
        let journal = match self.replay.journal.take() {
            Some(journal) => journal,
            None => self.store.journal_keys(&self.fence).await?,
        };
        self.replay.asked.insert(key.to_owned());
        let replayed = journal.iter().any(|k| k == key);
        let skipped: Vec<&str> = journal
            .iter()
            .filter(|k| !self.replay.asked.contains(*k))
            .map(String::as_str)
            .collect();
        let outcome = if replayed || optional {
            Ok(())
        } else if skipped.is_empty() {
            // Past the journal's end: everything from here on is new.
            self.replay.armed = false;
            Ok(())
        } else {
            let skipped = skipped.join(", ");
            Err(StepError::permanent(
                "journal_mismatch",
                format!(
                    "the workflow's code no longer matches this job's journal: step {step:?} \
                     asks for {key}, which the journal lacks, while journaled {skipped} was never asked for"
                ),
                format!(
                    "step {step:?} asks for {key}, not in the journal, before journaled {skipped}; \
                     nothing was sent. Ship a changed body as a new Workflow::VERSION beside the old one, then redrive"
                ),
            ))
        };
        self.replay.journal = Some(journal);
        outcome
    }

    /// Waits until its key's limit admits `ask`, holding no connection.
    /// The call queues on this node by priority; the best queued call is
    /// woken when any node releases a slot of the key or an admission
    /// leaves room, and asks again after a second; the others are woken in
    /// turn (and after ten seconds at most, as a safety net). Under a rate
    /// limit each call also wakes when the bucket will have refilled for
    /// it. Returns whether it had to wait.
    async fn wait_for_slot(&self, ask: &mut Ask<'_>) -> Result<bool, StepError> {
        let started = std::time::Instant::now();
        let mut waited = false;
        let mut place = self.limiter.enqueue(ask.key, ask.priority);
        let (provider, model) = ask.key.split_once('/').unwrap_or(("", ask.key));
        let (provider, model) = self.limiter.limits().labels(provider, model);
        let metrics = self.scope.metrics();
        loop {
            self.not_draining()?;
            ask.refresh_node = waited && place.is_best();
            match self.store.take_slot(ask).await? {
                Admission::Admitted { saturation } => {
                    metrics.limit_saturation(provider, model, saturation);
                    if waited {
                        metrics.limit_wait(provider, model, started.elapsed());
                    }
                    return Ok(waited);
                }
                Admission::Fenced => return Err(StepError::LeaseLost),
                Admission::Wait { retry_in, since_us } => {
                    place.queued_since(since_us);
                    if !waited {
                        metrics.limit_saturation(provider, model, 1.0);
                    }
                    waited = true;
                    ask.queued = true;
                    let fallback = if place.is_best() {
                        Duration::from_secs(1)
                    } else {
                        Duration::from_secs(10)
                    };
                    let pause = retry_in.map_or(fallback, |s| {
                        Duration::from_secs_f64(s.clamp(0.002, fallback.as_secs_f64()))
                    });
                    tokio::select! {
                        _ = place.woken() => {}
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    /// Sends a streamed model call and journals its text as it arrives
    /// (group-committed: the chunks that arrive while a write commits form
    /// the next), so watchers are shown only what is durable. Returns the
    /// call's outcome and the chunks it journaled.
    ///
    /// When the journal already holds part of this call's stream (an
    /// earlier attempt broke off), the same request goes out under the same
    /// key and the new stream is checked against what was shown: while it
    /// repeats it, nothing is journaled again (watchers see no repeat), and
    /// what comes after it continues the same generation. If it differs, a
    /// `reset` row saying why opens a new generation, which journals the
    /// new answer from its start: the journal keeps both, and watchers see
    /// exactly one reset. See LIFECYCLE.md, "A stream that fails halfway".
    async fn stream_chat(
        &self,
        key: &str,
        request: &Value,
        traceparent: &str,
        (provider, model): (&str, &str),
    ) -> Result<(Result<(Value, Usage, u16), PostError>, usize), StepError> {
        let journaled = self.store.journaled_stream(self.job_id(), key).await?;
        let mut tape = Tape::new(journaled);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let started = std::time::Instant::now();
        let first = std::sync::Mutex::new(None::<std::time::Instant>);
        let send = async {
            let mut on_text = |text: &str| {
                first
                    .lock()
                    .expect("lock")
                    .get_or_insert_with(std::time::Instant::now);
                let _ = tx.send(text.to_owned());
            };
            let sent = self
                .provider
                .chat_stream(
                    key,
                    request,
                    traceparent,
                    &self.faults,
                    self.job_id(),
                    &mut on_text,
                )
                .await;
            drop(tx);
            Ok::<_, StepError>(sent)
        };
        let journal = async {
            let mut chunks = 0usize;
            while let Some(text) = rx.recv().await {
                let mut texts = vec![text];
                while let Ok(more) = rx.try_recv() {
                    texts.push(more);
                }
                let rows = tape.accept(&texts);
                let written = self.write_stream(key, &tape, rows).await?;
                if chunks == 0 && written > 0 {
                    // Mid-stream: shown so far, the rest still to come.
                    self.faults
                        .hit(self.job_id(), crate::faults::FailPoint::StreamChunk)
                        .await?;
                }
                chunks += written;
            }
            Ok::<_, StepError>(chunks)
        };
        let (sent, mut chunks) = tokio::try_join!(send, journal)?;
        if sent.is_ok() {
            // An answer shorter than what was shown is a different answer.
            let rows = tape.finish();
            chunks += self.write_stream(key, &tape, rows).await?;
            if let Some(first) = *first.lock().expect("lock") {
                let ttft = first - started;
                let pace = sent.as_ref().ok().and_then(|(_, usage, _)| {
                    let tokens = f64::from(usage.output_tokens?);
                    let secs = first.elapsed().as_secs_f64();
                    (secs > 0.0).then(|| tokens / secs)
                });
                let (_, label) = self.limiter.limits().labels(provider, model);
                self.scope.metrics().stream(label, ttft, pace);
            }
        }
        Ok((sent, chunks))
    }

    /// Journals `rows` of `key`'s stream in the tape's generation; returns
    /// how many chunks that was.
    async fn write_stream(
        &self,
        key: &str,
        tape: &Tape,
        rows: Vec<StreamRow>,
    ) -> Result<usize, StepError> {
        if rows.is_empty() {
            return Ok(0);
        }
        let chunks = rows.iter().filter(|r| r.kind == "chunk").count();
        match self
            .store
            .journal_stream(&self.fence, key, tape.generation, rows)
            .await?
        {
            Checkpoint::Moved => Ok(chunks),
            _ => Err(StepError::LeaseLost),
        }
    }

    /// The job's id (its business id).
    pub fn job_id(&self) -> &str {
        &self.fence.job_id
    }

    /// This attempt's number (1 on the first run).
    pub fn attempt(&self) -> i32 {
        self.fence.attempt
    }

    /// Calls the model with an OpenAI chat-completions `request`, journaled
    /// under `job:{id}:{step}`. Returns the provider's full response.
    ///
    /// The request is journaled (key and request hash) before it is sent; a
    /// rerun returns the journaled response; a concurrent attempt waits for
    /// the one in flight; the same key with a different request is a
    /// permanent error and nothing is sent.
    pub async fn generate(&mut self, step: &str, request: &Value) -> Result<Value, StepError> {
        self.generate_served(step, request).await.map(|(v, _)| v)
    }

    /// Like [`generate`](Self::generate), also telling whether it was replayed.
    pub async fn generate_served(
        &mut self,
        step: &str,
        request: &Value,
    ) -> Result<(Value, Served), StepError> {
        let key = keys::model_call(&self.fence.key(), step);
        // Boxed, as every database call here: a query's future is large, and
        // an unboxed one widens the future every waiting job keeps.
        Box::pin(self.follow_journal(step, &key, false)).await?;
        let hash = canonical_hash(request);
        // The in-flight mark outlives the request timeout a little, so a
        // concurrent attempt does not send while ours may still be answered.
        let in_flight_ms = (self.provider.timeout() + Duration::from_secs(5)).as_millis() as i64;
        let metrics = self.scope.metrics().clone();
        let model = request
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let model_name = model.clone();
        let mut span = self.scope.step(
            SPAN_GENERATE,
            SpanKind::Client,
            vec![
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
                KeyValue::new(GEN_AI_OPERATION, "chat"),
                KeyValue::new(
                    GEN_AI_PROVIDER,
                    request
                        .get("provider")
                        .and_then(Value::as_str)
                        .unwrap_or("openai")
                        .to_owned(),
                ),
                KeyValue::new(GEN_AI_REQUEST_MODEL, model),
            ],
        );
        let attempt = loop {
            self.not_draining()?;
            // Boxed: the journal writes are not live while the model call
            // waits, so they need not widen the future every job keeps.
            match Box::pin(
                self.store
                    .begin_model_call(&self.fence, &key, &hash, in_flight_ms),
            )
            .await?
            {
                ModelCallStart::Completed(response) => {
                    metrics.model_call(OUTCOME_REPLAYED);
                    span.end(OUTCOME_REPLAYED);
                    return Ok((response, Served::Replayed));
                }
                ModelCallStart::Send { attempt } => break attempt,
                ModelCallStart::InFlight { until } => {
                    tracing::debug!(job.id = self.job_id(), key, %until, "model call in flight elsewhere; waiting");
                    tokio::time::sleep(self.wait_poll).await;
                }
                ModelCallStart::KeyConflict { stored_hash } => {
                    metrics.model_call(OUTCOME_FAILED);
                    span.set(KeyValue::new(ERROR_CODE, "model_key_conflict"));
                    return Err(StepError::permanent(
                        "model_key_conflict",
                        format!("model-call key {key} was journaled for a different request"),
                        format!(
                        "stored request hash {stored_hash}, this request {hash}; nothing was sent"
                    ),
                    ));
                }
                ModelCallStart::LeaseLost => {
                    span.end(OUTCOME_SUPPRESSED);
                    return Err(StepError::LeaseLost);
                }
            }
        };
        span.set(KeyValue::new("onceflow.send", i64::from(attempt)));
        // A provider limit (configured, or learned from a 429) admits the
        // call, over every node; it waits without a connection meanwhile.
        let provider_name = request
            .get("provider")
            .and_then(Value::as_str)
            .unwrap_or("openai")
            .to_owned();
        let limit_key = format!("{provider_name}/{model_name}");
        let spec = self.limiter.limits().spec(&provider_name, &model_name);
        let cap = spec.concurrency;
        let limited = Box::pin(self.limiter.limited(&self.store, &limit_key, spec.is_set())).await;
        // The slot's holder is this attempt's call: a takeover's is another.
        let holder = format!("{key}#{}", self.fence.epoch);
        let estimate = if spec.tpm.is_some() {
            crate::quota::estimate_tokens(request)
        } else {
            0.0
        };
        let mut slot = SlotGuard {
            store: self.store.clone(),
            key: limit_key.clone(),
            holder: holder.clone(),
            cap,
            armed: false,
        };
        if limited {
            slot.armed = true;
            let mut ask = Ask {
                key: &limit_key,
                holder: &holder,
                job_id: &self.fence.job_id,
                call_key: &key,
                epoch: self.fence.epoch,
                node: &self.fence.worker,
                lease_ms: in_flight_ms,
                spec,
                tokens: estimate,
                priority: self.priority,
                queued: false,
                refresh_node: false,
            };
            // Granted only while this attempt still holds the job, with the
            // call's in-flight mark renewed from the send.
            Box::pin(self.wait_for_slot(&mut ask)).await?;
        }
        let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
        let sent = if streaming {
            // A stream may outlast the request timeout that sized the call's
            // in-flight mark and its provider slot: both are renewed while
            // it flows, so no concurrent attempt sends and no other call
            // takes the slot meanwhile.
            let renew = async {
                let every = Duration::from_millis((in_flight_ms / 3).max(100) as u64);
                loop {
                    tokio::time::sleep(every).await;
                    let slot = limited.then_some((limit_key.as_str(), holder.as_str()));
                    if let Err(e) = self
                        .store
                        .renew_call(&key, self.fence.epoch, slot, in_flight_ms)
                        .await
                    {
                        tracing::warn!(error = %e, key, "could not renew a streaming call's marks");
                    }
                }
            };
            let traceparent = span.traceparent();
            let stream = Box::pin(self.stream_chat(
                &key,
                request,
                &traceparent,
                (&provider_name, &model_name),
            ));
            let (sent, chunks) = tokio::select! {
                streamed = stream => streamed?,
                () = renew => unreachable!("the renewal loop never ends"),
            };
            span.set(KeyValue::new(STREAM_CHUNKS, chunks as i64));
            sent
        } else {
            self.provider
                .chat(
                    &key,
                    request,
                    &span.traceparent(),
                    &self.faults,
                    self.job_id(),
                )
                .await
        };
        let end = match &sent {
            Ok(_) => CallEnd::Answered,
            Err(PostError::Failed(f)) => on_call_failure(f).call_end(),
            Err(PostError::Injected(_)) => CallEnd::Other,
        };
        if end == CallEnd::Throttled {
            let (provider, model) = self.limiter.limits().labels(&provider_name, &model_name);
            metrics.throttled(provider, model);
            self.limiter.learn(&limit_key);
        }
        slot.armed = false;
        // What the call cost against `tpm` beyond its estimate: a refused
        // call cost nothing, an answered one what its usage says.
        let tokens_over = match (&sent, end) {
            (_, CallEnd::Throttled) => -estimate,
            (Ok((_, usage, _)), _) if spec.tpm.is_some() => {
                match (usage.input_tokens, usage.output_tokens) {
                    (Some(i), Some(o)) => f64::from(i) + f64::from(o) - estimate,
                    _ => 0.0,
                }
            }
            _ => 0.0,
        };
        if limited || end == CallEnd::Throttled {
            if let Err(e) =
                Box::pin(
                    self.store
                        .end_call(&limit_key, &holder, end, cap, tokens_over),
                )
                .await
            {
                // The slot lapses at its expiry; the window learns next time.
                tracing::warn!(error = %e, key = %limit_key, "could not release a provider slot");
            }
        }
        match sent {
            Ok((response, usage, status)) => {
                span.set(KeyValue::new(HTTP_STATUS, i64::from(status)));
                if let Some(m) = response.get("model").and_then(Value::as_str) {
                    span.set(KeyValue::new(GEN_AI_RESPONSE_MODEL, m.to_owned()));
                }
                for (name, n) in [
                    (GEN_AI_INPUT_TOKENS, usage.input_tokens),
                    (GEN_AI_OUTPUT_TOKENS, usage.output_tokens),
                ] {
                    if let Some(n) = n {
                        span.set(KeyValue::new(name, i64::from(n)));
                    }
                }
                // Tokens are spent whether or not the journal commit lands.
                metrics.tokens(usage.input_tokens, usage.output_tokens, attempt > 1);
                if let Some(problem) =
                    invalid_answer(&response, usage.input_tokens, usage.output_tokens)
                {
                    // PostgreSQL would refuse to journal it (and, in a batch,
                    // refuse its batchmates' rows with it): this job alone
                    // fails, non-retryably, and the rest proceed.
                    metrics.model_call(OUTCOME_FAILED);
                    span.set(KeyValue::new(ERROR_CODE, "invalid_model_response"));
                    span.end(OUTCOME_FAILED);
                    let error = ErrorEnvelope {
                        code: "invalid_model_response".into(),
                        message: format!(
                            "the provider's answer to {key} cannot be journaled: {problem}"
                        ),
                        retryable: false,
                    };
                    let held = Box::pin(self.store.fail_model_call(
                        &self.fence,
                        &key,
                        &FailedSend {
                            error: error.clone(),
                            status: Some(i32::from(status)),
                        },
                    ))
                    .await?;
                    if !held {
                        return Err(StepError::LeaseLost);
                    }
                    return Err(StepError::Permanent {
                        reason: format!("invalid model response ({key})"),
                        error,
                    });
                }
                match Box::pin(self.store.complete_model_call(
                    &self.fence,
                    &key,
                    &response,
                    (usage.input_tokens, usage.output_tokens),
                    &self.faults,
                ))
                .await?
                {
                    Checkpoint::Moved => {
                        metrics.model_call(OUTCOME_PERFORMED);
                        span.end(OUTCOME_PERFORMED);
                        Ok((response, Served::Performed))
                    }
                    Checkpoint::Faulted => {
                        Err(StepError::Injected(crate::faults::Injected::Crash(
                            crate::faults::FailPoint::BeforeCommit("model_call"),
                        )))
                    }
                    Checkpoint::LeaseLost | Checkpoint::AlreadyAt(_) => Err(StepError::LeaseLost),
                }
            }
            Err(PostError::Injected(injected)) => {
                // A failpoint after the send: to the engine, a lost answer.
                if matches!(injected, crate::faults::Injected::Fail(_)) {
                    metrics.model_call(OUTCOME_RETRIED);
                    span.end(OUTCOME_RETRIED);
                }
                Err(injected.into())
            }
            Err(PostError::Failed(failure)) => {
                let error = failure.envelope();
                if let Some(status) = failure.status() {
                    span.set(KeyValue::new(HTTP_STATUS, i64::from(status)));
                }
                span.set(KeyValue::new(ERROR_CODE, error.code.clone()));
                let verdict = on_call_failure(&failure);
                let outcome = if verdict.retries() {
                    OUTCOME_RETRIED
                } else {
                    OUTCOME_FAILED
                };
                metrics.model_call(outcome);
                span.end(outcome);
                let held = Box::pin(self.store.fail_model_call(
                    &self.fence,
                    &key,
                    &FailedSend {
                        error: error.clone(),
                        status: failure.status().map(i32::from),
                    },
                ))
                .await?;
                if !held {
                    return Err(StepError::LeaseLost);
                }
                Err(if verdict.retries() {
                    StepError::Retry {
                        error,
                        attempt: attempt.max(1) as u32,
                        retry_after: verdict.retry_after(),
                    }
                } else {
                    StepError::Permanent {
                        reason: format!("the model provider refused the request ({key})"),
                        error: ErrorEnvelope {
                            retryable: false,
                            ..error
                        },
                    }
                })
            }
        }
    }
}

/// Why a provider's 2xx answer cannot be journaled as it is, if it cannot:
/// a NUL character anywhere (PostgreSQL's `jsonb` refuses `\u0000`) or a
/// negative token count. Such an answer is `invalid_model_response` for its
/// job alone; onceflow does not rewrite what the model said.
pub(crate) fn invalid_answer(
    response: &Value,
    input_tokens: Option<i32>,
    output_tokens: Option<i32>,
) -> Option<String> {
    if crate::store::journal::contains_nul(response) {
        return Some("it contains a NUL character (\\u0000)".into());
    }
    if input_tokens.is_some_and(|n| n < 0) || output_tokens.is_some_and(|n| n < 0) {
        return Some(format!(
            "negative token usage (input {input_tokens:?}, output {output_tokens:?})"
        ));
    }
    None
}

/// What a tool's execution gets: who asked, and the key to pass on.
#[derive(Debug, Clone)]
pub struct ToolInvocation {
    /// The job whose model asked for the tool call.
    pub job_id: String,
    /// The provider's id of this call (recorded, not trusted to be unique).
    pub tool_call_id: String,
    /// `job:{id}:tool:{turn}:{index}`: send it with the tool's own outbound
    /// request so the receiver can drop a repeat.
    pub idempotency_key: String,
    /// The guarded client (no redirects; names resolved through the guard).
    pub client: reqwest::Client,
    /// How long the tool's outbound request may take (the node's webhook timeout).
    pub timeout: Duration,
    /// The job's W3C trace context, to send along (`traceparent`).
    pub traceparent: String,
    /// The SSRF guard: the model chooses a tool's arguments, so whatever URL
    /// a tool posts to is checked like a caller's `webhook_url`.
    pub guard: crate::guard::UrlGuard,
    /// Largest answer [`post_json`](Self::post_json) reads; more is
    /// `response_too_large`.
    pub response_limit: usize,
}

/// What a general step's work gets.
#[derive(Debug, Clone)]
pub struct StepInvocation {
    /// The job running the step.
    pub job_id: String,
    /// `job:{id}:step:{name}`: send it with the step's own side effect.
    pub idempotency_key: String,
    /// The guarded client (no redirects; names resolved through the guard).
    pub client: reqwest::Client,
    /// The job's W3C trace context, to send along (`traceparent`).
    pub traceparent: String,
    /// The SSRF guard for the step's own requests.
    pub guard: crate::guard::UrlGuard,
    /// Largest answer a step should read.
    pub response_limit: usize,
}

impl ToolInvocation {
    /// POSTs `body` as JSON to `url` with this call's `Idempotency-Key`;
    /// returns the response body as text. 408, 429, 5xx and network errors
    /// are retryable, other statuses permanent.
    pub async fn post_json(&self, url: &str, body: &Value) -> Result<String, StepError> {
        let request = crate::outbound::Post {
            url,
            headers: vec![
                ("idempotency-key", self.idempotency_key.clone()),
                ("tool-call-id", self.tool_call_id.clone()),
                ("traceparent", self.traceparent.clone()),
            ],
            body: serde_json::to_vec(body).expect("a JSON value serialises"),
            timeout: self.timeout,
            read: crate::outbound::Read::Body {
                limit: self.response_limit,
            },
            guard: Some(&self.guard),
        };
        match crate::outbound::post(&self.client, request, None).await {
            Ok((_, bytes)) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            Err(PostError::Injected(i)) => Err(i.into()),
            Err(PostError::Failed(f)) => match on_call_failure(&f) {
                verdict if verdict.retries() => Err(StepError::Retry {
                    error: f.envelope(),
                    attempt: 1,
                    retry_after: verdict.retry_after(),
                }),
                _ => Err(StepError::Permanent {
                    // The URL stays out: the job's owner reads the reason, and
                    // the operator's tool URL may carry a key in its query.
                    reason: "the tool's request was refused".to_owned(),
                    error: f.envelope(),
                }),
            },
        }
    }
}

impl Context {
    /// The HTTP client steps and tools should use.
    pub fn http(&self) -> &reqwest::Client {
        &self.client
    }

    /// Executes a tool call at most once per position (`turn`, `index`) in
    /// the conversation: recorded before `execute` runs, its result stored
    /// after; a replay returns the stored result byte for byte. The same
    /// position with another tool-call id or other arguments is a permanent
    /// error and nothing is executed.
    pub async fn tool<F, Fut>(
        &mut self,
        turn: i32,
        index: i32,
        tool_call_id: &str,
        tool_name: &str,
        arguments: &Value,
        execute: F,
    ) -> Result<String, StepError>
    where
        F: FnOnce(ToolInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<String, StepError>>,
    {
        use crate::store::ledger::{Position, ToolCallSpec, ToolCallStart};
        let position = Position { turn, index };
        let hash = canonical_hash(arguments);
        let spec = ToolCallSpec {
            position,
            tool_call_id,
            tool_name,
            arguments,
            arguments_hash: &hash,
        };
        if crate::store::journal::contains_nul(arguments) {
            return Err(StepError::permanent(
                "invalid_tool_call",
                format!(
                    "tool call {tool_call_id} at turn {turn}, index {index} cannot be journaled"
                ),
                "its arguments contain a NUL character (\\u0000); nothing was executed",
            ));
        }
        let in_flight_ms = (self.tool_timeout + Duration::from_secs(5)).as_millis() as i64;
        let key = keys::tool(&self.fence.key(), turn, index);
        self.follow_journal(&format!("tool:{turn}:{index}"), &key, false)
            .await?;
        let metrics = self.scope.metrics().clone();
        let mut span = self.scope.step(
            SPAN_TOOL,
            SpanKind::Client,
            vec![
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
                KeyValue::new(GEN_AI_TOOL_NAME, tool_name.to_owned()),
                KeyValue::new(GEN_AI_TOOL_CALL_ID, tool_call_id.to_owned()),
            ],
        );
        let attempt = loop {
            self.not_draining()?;
            match self
                .store
                .begin_tool_call(&self.fence, &spec, in_flight_ms)
                .await?
            {
                ToolCallStart::Completed(result) => {
                    metrics.tool(OUTCOME_REPLAYED);
                    span.end(OUTCOME_REPLAYED);
                    return Ok(result);
                }
                ToolCallStart::Execute { attempt } => break attempt,
                ToolCallStart::InFlight { .. } => tokio::time::sleep(self.wait_poll).await,
                ToolCallStart::LeaseLost => {
                    span.end(OUTCOME_SUPPRESSED);
                    return Err(StepError::LeaseLost);
                }
                ToolCallStart::Conflict {
                    stored_id,
                    stored_hash,
                } => {
                    metrics.tool(OUTCOME_FAILED);
                    span.set(KeyValue::new(ERROR_CODE, "tool_call_conflict"));
                    return Err(StepError::permanent(
                        "tool_call_conflict",
                        format!(
                            "tool call {tool_call_id} at turn {turn}, index {index} does not match the ledger"
                        ),
                        format!(
                            "the ledger holds call {stored_id} with arguments hash {stored_hash}; this call has \
                             arguments hash {hash}; nothing was executed"
                        ),
                    ));
                }
            }
        };
        let invocation = ToolInvocation {
            job_id: self.fence.job_id.clone(),
            tool_call_id: tool_call_id.to_owned(),
            idempotency_key: key,
            client: self.client.clone(),
            timeout: self.tool_timeout,
            traceparent: span.traceparent(),
            guard: self.guard.clone(),
            response_limit: self.tool_response_limit,
        };
        let result = match execute(invocation).await {
            Ok(result) => result,
            Err(error) => {
                let permanent = !on_tool_error(&error).retries();
                let outcome = if permanent {
                    OUTCOME_FAILED
                } else {
                    OUTCOME_RETRIED
                };
                metrics.tool(outcome);
                span.set(KeyValue::new(ERROR_CODE, error.envelope().code));
                span.end(outcome);
                if !self
                    .store
                    .fail_tool_call(&self.fence, position, &error.envelope(), permanent)
                    .await?
                {
                    return Err(StepError::LeaseLost);
                }
                return Err(match error {
                    StepError::Retry {
                        error, retry_after, ..
                    } => StepError::Retry {
                        error,
                        attempt: attempt.max(1) as u32,
                        retry_after,
                    },
                    other => other,
                });
            }
        };
        if result.contains('\0') {
            // The ledger stores the result as text, which refuses NUL: the
            // call failed for good, recorded as such (fenced).
            let error = crate::error::ErrorEnvelope {
                code: "invalid_tool_result".into(),
                message: format!("the result of tool call {tool_call_id} contains a NUL character"),
                retryable: false,
            };
            metrics.tool(OUTCOME_FAILED);
            span.set(KeyValue::new(ERROR_CODE, "invalid_tool_result"));
            span.end(OUTCOME_FAILED);
            if !self
                .store
                .fail_tool_call(&self.fence, position, &error, true)
                .await?
            {
                return Err(StepError::LeaseLost);
            }
            return Err(StepError::Permanent {
                reason: format!("invalid tool result ({tool_name})"),
                error,
            });
        }
        self.faults
            .hit(self.job_id(), crate::faults::FailPoint::ToolAfterEffect)
            .await?;
        if !self
            .store
            .complete_tool_call(&self.fence, position, &result)
            .await?
        {
            span.end(OUTCOME_SUPPRESSED);
            return Err(StepError::LeaseLost);
        }
        metrics.tool(OUTCOME_PERFORMED);
        span.end(OUTCOME_PERFORMED);
        Ok(result)
    }

    /// Runs `work` once per job under step `name` and journals its output; a
    /// rerun returns the journaled output. A crash after `work` and before
    /// the journal commit runs it again, with the same
    /// [`StepInvocation::idempotency_key`]: pass that key to the side effect
    /// so its receiver can drop the repeat.
    pub async fn step<T, F, Fut>(&mut self, name: &str, work: F) -> Result<T, StepError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(StepInvocation) -> Fut,
        Fut: std::future::Future<Output = Result<T, StepError>>,
    {
        let key = keys::step(&self.fence.key(), name);
        self.follow_journal(name, &key, true).await?;
        let decode = |text: &str| {
            serde_json::from_str::<T>(text)
                .map_err(|e| StepError::Serialize(format!("journaled output of step {name}: {e}")))
        };
        let span = self.scope.step(
            SPAN_STEP,
            SpanKind::Internal,
            vec![
                KeyValue::new(STEP, name.to_owned()),
                KeyValue::new(IDEMPOTENCY_KEY, key.clone()),
            ],
        );
        // Fenced before the work runs: a cancelled or taken-over attempt
        // runs no step body.
        match self.store.begin_step(&self.fence, &key).await? {
            None => {
                span.end(OUTCOME_SUPPRESSED);
                return Err(StepError::LeaseLost);
            }
            Some(Some(stored)) => {
                span.end(OUTCOME_REPLAYED);
                return decode(&stored);
            }
            Some(None) => {}
        }
        self.not_draining()?;
        let output = work(StepInvocation {
            job_id: self.fence.job_id.clone(),
            idempotency_key: key.clone(),
            client: self.client.clone(),
            traceparent: span.traceparent(),
            guard: self.guard.clone(),
            response_limit: self.tool_response_limit,
        })
        .await?;
        self.faults
            .hit(self.job_id(), crate::faults::FailPoint::StepAfterEffect)
            .await?;
        let text =
            serde_json::to_string(&output).map_err(|e| StepError::Serialize(e.to_string()))?;
        match self.store.record_step(&self.fence, &key, &text).await? {
            Some(stored) => {
                span.end(OUTCOME_PERFORMED);
                decode(&stored)
            }
            None => {
                span.end(OUTCOME_SUPPRESSED);
                Err(StepError::LeaseLost)
            }
        }
    }
}

/// A streamed call's place in its journal: what was shown before (the
/// latest generation's text), how much of it the new stream has repeated,
/// and where the next chunk goes.
#[derive(Debug)]
pub(crate) struct Tape {
    /// The generation chunks are journaled in.
    pub(crate) generation: i32,
    next_offset: i32,
    /// What watchers were shown of this generation before this attempt.
    shown: String,
    /// This attempt's text so far.
    got: String,
    /// Whether the new stream is still repeating `shown`.
    verifying: bool,
}

impl Tape {
    pub(crate) fn new(journaled: crate::store::streams::Journaled) -> Self {
        Tape {
            generation: journaled.generation.max(1),
            next_offset: journaled.next_offset,
            verifying: !journaled.text.is_empty(),
            shown: journaled.text,
            got: String::new(),
        }
    }

    /// Takes the texts that arrived; returns the rows to journal.
    pub(crate) fn accept(&mut self, texts: &[String]) -> Vec<StreamRow> {
        for t in texts {
            self.got.push_str(t);
        }
        if !self.verifying {
            return texts.iter().map(|t| self.chunk(t.clone())).collect();
        }
        let (shown, got) = (self.shown.as_bytes(), self.got.as_bytes());
        if got.len() <= shown.len() {
            if shown.starts_with(got) {
                return Vec::new();
            }
        } else if got.starts_with(shown) {
            // Past what was shown: the rest continues this generation, one
            // row per text as a stream that never broke would have written
            // (the text that straddles the end of what was shown, cut).
            self.verifying = false;
            let mut upto = self.got.len() - texts.iter().map(String::len).sum::<usize>();
            let mut rows = Vec::new();
            for t in texts {
                let end = upto + t.len();
                if end > self.shown.len() {
                    let from = self.shown.len().max(upto) - upto;
                    rows.push(self.chunk(t[from..].to_owned()));
                }
                upto = end;
            }
            return rows;
        }
        self.reset()
    }

    /// The stream ended: an answer that stopped inside what was shown is a
    /// different answer.
    pub(crate) fn finish(&mut self) -> Vec<StreamRow> {
        if self.verifying && self.got.len() < self.shown.len() {
            self.reset()
        } else {
            Vec::new()
        }
    }

    fn chunk(&mut self, text: String) -> StreamRow {
        let row = StreamRow {
            offset: self.next_offset,
            kind: "chunk",
            text,
        };
        self.next_offset += 1;
        row
    }

    /// A new generation, announced by a reset with its reason, holding the
    /// new answer from its start.
    fn reset(&mut self) -> Vec<StreamRow> {
        let at = self
            .shown
            .bytes()
            .zip(self.got.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let reason = format!(
            "the provider's answer to the repeated request differs from the {} bytes already shown, \
             from byte {at}; the answer restarts as generation {}",
            self.shown.len(),
            self.generation + 1
        );
        self.generation += 1;
        self.next_offset = 0;
        self.verifying = false;
        let mut rows = vec![StreamRow {
            offset: -1,
            kind: "reset",
            text: reason,
        }];
        if !self.got.is_empty() {
            let all = self.got.clone();
            rows.push(self.chunk(all));
        }
        rows
    }
}

#[cfg(test)]
mod tape_tests {
    use super::*;
    use crate::store::streams::Journaled;

    fn texts(rows: &[StreamRow]) -> Vec<(i32, &str, &str)> {
        rows.iter()
            .map(|r| (r.offset, r.kind, r.text.as_str()))
            .collect()
    }

    #[test]
    fn a_fresh_stream_journals_every_chunk_in_generation_one() {
        let mut t = Tape::new(Journaled::default());
        assert_eq!(t.generation, 1);
        let rows = t.accept(&["a".into(), "b".into()]);
        assert_eq!(texts(&rows), vec![(0, "chunk", "a"), (1, "chunk", "b")]);
        assert!(t.finish().is_empty());
    }

    #[test]
    fn a_replayed_stream_is_verified_and_continues_after_what_was_shown() {
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello wor".into(),
            next_offset: 3,
        });
        assert!(t.accept(&["hel".into()]).is_empty());
        assert!(t.accept(&["lo ".into(), "wo".into()]).is_empty());
        let rows = t.accept(&["rld".into()]);
        assert_eq!(texts(&rows), vec![(3, "chunk", "ld")]);
        assert_eq!(t.generation, 1);
        assert_eq!(texts(&t.accept(&["!".into()])), vec![(4, "chunk", "!")]);
        // Texts that arrive together past what was shown keep a row each,
        // as a stream that never broke would have journaled them.
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello wor".into(),
            next_offset: 3,
        });
        let rows = t.accept(&["hel".into(), "lo wo".into(), "rld".into(), "!".into()]);
        assert_eq!(texts(&rows), vec![(3, "chunk", "ld"), (4, "chunk", "!")]);
    }

    #[test]
    fn a_different_answer_resets_once_into_a_new_generation() {
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello".into(),
            next_offset: 2,
        });
        assert!(t.accept(&["he".into()]).is_empty());
        let rows = t.accept(&["y".into()]);
        assert_eq!(rows[0].kind, "reset");
        assert_eq!(rows[0].offset, -1);
        assert_eq!(texts(&rows[1..]), vec![(0, "chunk", "hey")]);
        assert_eq!(t.generation, 2);
        assert_eq!(texts(&t.accept(&["!".into()])), vec![(1, "chunk", "!")]);
        // A shorter answer that stopped inside what was shown differs too.
        let mut t = Tape::new(Journaled {
            generation: 2,
            text: "hello".into(),
            next_offset: 1,
        });
        assert!(t.accept(&["hel".into()]).is_empty());
        let rows = t.finish();
        assert_eq!(rows[0].kind, "reset");
        assert_eq!(t.generation, 3);
    }
}
