//! `ctx.generate`: one model call, journaled under its key, admitted by the
//! provider's limit, sent plain or streamed, its outcome recorded under the
//! fence and judged by [`crate::rules::verdict::on_call_failure`].

use std::time::Duration;

use onceflow_observability::names::*;
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use serde_json::Value;

use super::tape::Tape;
use super::{Context, Served};
use crate::attempt_spans::StepSpan;
use crate::error::{ErrorEnvelope, StepError};
use crate::net::outbound::PostError;
use crate::net::provider::Usage;
use crate::request::canonical_hash;
use crate::rules::keys;
use crate::rules::quota::{CallEnd, LimitSpec};
use crate::rules::verdict::on_call_failure;
use crate::store::journal::{FailedSend, ModelCallStart};
use crate::store::slots::{Admission, Ask};
use crate::store::streams::StreamRow;
use crate::store::{Checkpoint, Store};

/// A provider's answer: the response, its token usage and HTTP status.
type Answer = (Value, Usage, u16);

/// One model call as the phases of [`Context::generate_served`] see it.
struct Call<'r> {
    request: &'r Value,
    /// `job:{id}:{step}`.
    key: String,
    hash: String,
    /// The in-flight mark outlives the request timeout a little, so a
    /// concurrent attempt does not send while ours may still be answered.
    in_flight_ms: i64,
    provider: String,
    model: String,
    /// Whether its job may be parked while it waits for a provider slot
    /// (no other call of the attempt is in flight).
    may_park: bool,
}

impl<'r> Call<'r> {
    fn new(ctx: &Context, key: String, request: &'r Value) -> Self {
        let text = |field: &str, default: &str| {
            request
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or(default)
                .to_owned()
        };
        Call {
            request,
            hash: canonical_hash(request),
            in_flight_ms: (ctx.provider.timeout() + Duration::from_secs(5)).as_millis() as i64,
            provider: text("provider", "openai"),
            model: text("model", ""),
            key,
            may_park: false,
        }
    }
}

/// The call's place under its provider limit.
struct Quota {
    /// `provider/model`.
    limit_key: String,
    /// This attempt's call (`{key}#{epoch}`): a takeover's is another.
    holder: String,
    spec: LimitSpec,
    /// Whether a limit applies (configured or learned).
    limited: bool,
    /// Tokens the call is charged in advance against `tpm`.
    estimate: f64,
}

/// What the journal says about a call.
enum Begun {
    /// This attempt sends; the `attempt`-th send of the key.
    Send { attempt: i32 },
    /// Journaled already: the response, and nothing is sent.
    Replayed(Value),
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
                    .limits()
                    .end_call(&key, &holder, CallEnd::Other, cap, 0.0)
                    .await;
            });
        }
    }
}

/// Most model calls one `generate_all` sends at once.
pub const MAX_PARALLEL_CALLS: usize = 100;

impl Context {
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
            match self.store.limits().take_slot(ask).await? {
                Admission::Admitted { saturation } => {
                    metrics.limit_saturation(provider, model, saturation);
                    if waited {
                        metrics.limit_wait(provider, model, started.elapsed());
                    }
                    return Ok(waited);
                }
                Admission::Fenced => return Err(StepError::LeaseLost),
                // No slot free: the job was let go, holding no node
                // capacity, until a slot of its key frees.
                Admission::Parked { until, left_ms } => {
                    metrics.limit_saturation(provider, model, 1.0);
                    return Err(StepError::Waiting {
                        kind: "provider",
                        name: ask.key.to_owned(),
                        until,
                        due: crate::store::waits::due_in(left_ms),
                    });
                }
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
        let journaled = self.store.journal().streamed(self.job_id(), key).await?;
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
        self.journal_stream(key, tape.generation, rows).await?;
        Ok(chunks)
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
    ///
    /// A call goes through four phases, each a method of its own: the
    /// journal (`begin_call`: replay, wait for a sibling, or send), the
    /// limiter (`admit`: a provider slot, fenced), the send (`send`: plain
    /// or streamed, its marks renewed), and the outcome (`release` the slot,
    /// then `record_answer` or `record_failure`, which asks the verdict).
    pub async fn generate_served(
        &mut self,
        step: &str,
        request: &Value,
    ) -> Result<(Value, Served), StepError> {
        let key = keys::model_call(&self.fence.key(), step);
        // Boxed, as every database call here: a query's future is large, and
        // an unboxed one widens the future every waiting job keeps.
        Box::pin(self.follow_journal(step, &key, false)).await?;
        self.serve_call(key, request, true).await
    }

    /// Calls the model once per `(step, request)`, all at once, each
    /// journaled under its own key (`job:{id}:{step}`) exactly as
    /// [`generate`](Self::generate) journals one; returns the responses in
    /// the order given. A rerun after a crash replays the calls that were
    /// answered and sends only the others; each call waits for its own
    /// provider slot, so `ONCEFLOW_LIMITS` holds across the batch. When a
    /// call fails for the attempt as a whole (the lease lost, the node
    /// draining, an injected crash), the others are dropped at once, as a
    /// crash would; other failures let the rest finish (and be journaled),
    /// then a permanent one is returned before a retryable one. Steps must
    /// be distinct; at most [`MAX_PARALLEL_CALLS`] per batch.
    pub async fn generate_all(
        &mut self,
        calls: &[(&str, &Value)],
    ) -> Result<Vec<Value>, StepError> {
        use futures_util::stream::FuturesUnordered;
        if calls.len() > MAX_PARALLEL_CALLS {
            return Err(StepError::permanent(
                "too_many_calls",
                format!("generate_all takes at most {MAX_PARALLEL_CALLS} calls at once"),
                format!("the body gave {}", calls.len()),
            ));
        }
        let keys: Vec<String> = calls
            .iter()
            .map(|(step, _)| keys::model_call(&self.fence.key(), step))
            .collect();
        if let Some(dup) = keys
            .iter()
            .enumerate()
            .find(|(i, k)| keys[..*i].contains(k))
        {
            return Err(StepError::permanent(
                "duplicate_step",
                format!("generate_all was given step key {} twice", dup.1),
                "each call of a batch needs its own step name".to_owned(),
            ));
        }
        // The batch's calls were journaled in whatever order they began:
        // asked together, none of them counts as skipped by another.
        if self.replay.armed {
            self.replay.asked.extend(keys.iter().cloned());
        }
        for ((step, _), key) in calls.iter().zip(&keys) {
            Box::pin(self.follow_journal(step, key, false)).await?;
        }
        let this = &*self;
        // Alone, a call waiting for a provider slot parks its job; beside
        // others of the same attempt, it waits in place (parking would let
        // the job go under calls in flight).
        let alone = calls.len() == 1;
        let running: FuturesUnordered<_> = calls
            .iter()
            .zip(keys)
            .enumerate()
            .map(|(i, ((_, request), key))| {
                Box::pin(async move {
                    let answer = this.serve_call(key, request, alone).await;
                    (i, answer.map(|(response, _)| response))
                })
            })
            .collect();
        super::gather(calls.len(), running).await
    }

    /// One model call under `key`, once the journal's order was checked.
    async fn serve_call(
        &self,
        key: String,
        request: &Value,
        may_park: bool,
    ) -> Result<(Value, Served), StepError> {
        let mut call = Call::new(self, key, request);
        call.may_park = may_park;
        let metrics = self.scope.metrics().clone();
        let mut span = self.scope.step(
            SPAN_GENERATE,
            SpanKind::Client,
            vec![
                KeyValue::new(IDEMPOTENCY_KEY, call.key.clone()),
                KeyValue::new(GEN_AI_OPERATION, "chat"),
                KeyValue::new(GEN_AI_PROVIDER, call.provider.clone()),
                KeyValue::new(GEN_AI_REQUEST_MODEL, call.model.clone()),
            ],
        );
        let held = Box::pin(self.within_budget(&call)).await?;
        let attempt = match Box::pin(self.begin_call(&call)).await {
            Ok(Begun::Send { attempt }) => attempt,
            Ok(Begun::Replayed(response)) => {
                metrics.model_call(OUTCOME_REPLAYED);
                span.end(OUTCOME_REPLAYED);
                return Ok((response, Served::Replayed));
            }
            Err(StepError::LeaseLost) => {
                span.end(OUTCOME_SUPPRESSED);
                return Err(StepError::LeaseLost);
            }
            Err(e) => {
                if let StepError::Permanent { error, .. } = &e {
                    metrics.model_call(OUTCOME_FAILED);
                    span.set(KeyValue::new(ERROR_CODE, error.code.clone()));
                }
                return Err(e);
            }
        };
        span.set(KeyValue::new("onceflow.send", i64::from(attempt)));
        let (quota, mut slot) = Box::pin(self.admit(&call)).await?;
        let sent = self.send(&call, &quota, &mut span).await?;
        slot.armed = false;
        Box::pin(self.release(&call, &quota, &sent)).await;
        match sent {
            Ok(answer) => {
                let recorded = Box::pin(self.record_answer(&call, attempt, answer, span)).await;
                // Its hold is settled: jobs other holds kept may fit now.
                if let (true, Some(owner), Ok(_)) = (held, self.owner_token, &recorded) {
                    if let Err(e) = Box::pin(self.store.waits().wake_held(owner)).await {
                        tracing::warn!(error = %e, "could not wake the jobs a budget hold kept");
                    }
                }
                recorded
            }
            Err(failure) => {
                // A failed call gives its budget hold back; it holds again
                // when it is sent again.
                if held {
                    if let Err(e) = Box::pin(self.store.waits().release_hold(&call.key)).await {
                        tracing::warn!(error = %e, "could not give a failed call's budget hold back");
                    }
                }
                Box::pin(self.record_failure(&call, attempt, failure, span)).await
            }
        }
    }

    /// The budget: a call of a token with a budget holds what it may use
    /// before it is sent (see [`Waits::budget`](crate::store::Waits::budget)),
    /// and its recorded answer settles the hold with its usage. A job whose
    /// token's model tokens for the day are spent sends nothing: it waits,
    /// holding no lease, until the next UTC day (`waiting: {"kind":
    /// "budget", "until"}`), or dies `budget_exhausted`, as the token says;
    /// one kept only by the holds of calls in flight waits until an answer
    /// settles one (`"reserved": true`). Checked before the journal, so
    /// nothing is journaled for a call that is not sent; a call answered
    /// already is a replay and passes. Returns whether the call holds a
    /// share.
    async fn within_budget(&self, call: &Call<'_>) -> Result<bool, StepError> {
        use crate::store::budgets::{hold_for, Budget, Hold};
        let hold = Hold {
            key: &call.key,
            tokens: hold_for(call.request),
            for_ms: call.in_flight_ms,
        };
        match Box::pin(
            self.store
                .waits()
                .budget(self.owner_token, &hold, &self.fence),
        )
        .await?
        {
            Budget::Open { held } => Ok(held),
            Budget::Fenced => Err(StepError::LeaseLost),
            Budget::Die { budget, spent } => Err(StepError::permanent(
                "budget_exhausted",
                "budget_exhausted: the token's model-token budget for the day is spent".to_owned(),
                format!("spent {spent} of {budget} model tokens today (UTC); nothing was sent"),
            )),
            Budget::Wait { until, left_ms, .. } => Err(StepError::Waiting {
                kind: "budget",
                name: "budget".to_owned(),
                until,
                due: crate::store::waits::due_in(left_ms),
            }),
        }
    }

    /// The journal: journals the intent to send under the call's key (fenced)
    /// and decides whether this attempt sends, waiting while a sibling
    /// attempt of the same lease has the call in flight.
    async fn begin_call(&self, call: &Call<'_>) -> Result<Begun, StepError> {
        loop {
            self.not_draining()?;
            // Boxed: the journal writes are not live while the model call
            // waits, so they need not widen the future every job keeps.
            match Box::pin(self.store.journal().begin_model_call(
                &self.fence,
                &call.key,
                &call.hash,
                call.in_flight_ms,
            ))
            .await?
            {
                ModelCallStart::Completed(response) => return Ok(Begun::Replayed(response)),
                ModelCallStart::Send { attempt } => return Ok(Begun::Send { attempt }),
                ModelCallStart::InFlight { until } => {
                    tracing::debug!(job.id = self.job_id(), key = call.key, %until, "model call in flight elsewhere; waiting");
                    tokio::time::sleep(self.wait_poll).await;
                }
                ModelCallStart::KeyConflict { stored_hash } => {
                    return Err(StepError::permanent(
                        "model_key_conflict",
                        format!(
                            "model-call key {} was journaled for a different request",
                            call.key
                        ),
                        format!(
                            "stored request hash {stored_hash}, this request {}; nothing was sent",
                            call.hash
                        ),
                    ));
                }
                ModelCallStart::LeaseLost => return Err(StepError::LeaseLost),
            }
        }
    }

    /// The limiter: a provider limit (configured, or learned from a 429)
    /// admits the call, over every node; it waits without a connection
    /// meanwhile. The slot is granted only while this attempt still holds
    /// the job, with the call's in-flight mark renewed from the send. The
    /// guard releases the slot if the call is dropped mid-way.
    async fn admit(&self, call: &Call<'_>) -> Result<(Quota, SlotGuard), StepError> {
        let limit_key = format!("{}/{}", call.provider, call.model);
        let spec = self.limiter.limits().spec(&call.provider, &call.model);
        let limited = Box::pin(self.limiter.limited(&self.store, &limit_key, spec.is_set())).await;
        let quota = Quota {
            // The slot's holder is this attempt's call: a takeover's is another.
            holder: format!("{}#{}", call.key, self.fence.epoch),
            estimate: if spec.tpm.is_some() {
                crate::rules::quota::estimate_tokens(call.request)
            } else {
                0.0
            },
            limit_key,
            spec,
            limited,
        };
        let mut slot = SlotGuard {
            store: self.store.clone(),
            key: quota.limit_key.clone(),
            holder: quota.holder.clone(),
            cap: quota.spec.concurrency,
            armed: false,
        };
        if quota.limited {
            slot.armed = true;
            let mut ask = Ask {
                key: &quota.limit_key,
                holder: &quota.holder,
                job_id: &self.fence.job_id,
                call_key: &call.key,
                epoch: self.fence.epoch,
                node: &self.fence.worker,
                lease_ms: call.in_flight_ms,
                spec: quota.spec,
                tokens: quota.estimate,
                priority: self.priority,
                queued: false,
                refresh_node: false,
                park: call.may_park.then_some(&self.fence),
            };
            match Box::pin(self.wait_for_slot(&mut ask)).await {
                Ok(_) => {}
                // Parked: it holds no slot and no waiter row, so nothing
                // is released (a release would wake the next parked job).
                Err(e @ StepError::Waiting { .. }) => {
                    slot.armed = false;
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok((quota, slot))
    }

    /// The send: the provider's answer, or why there is none. A stream may
    /// outlast the request timeout that sized the call's in-flight mark and
    /// its provider slot: both are renewed while it flows, so no concurrent
    /// attempt sends and no other call takes the slot meanwhile.
    async fn send(
        &self,
        call: &Call<'_>,
        quota: &Quota,
        span: &mut StepSpan,
    ) -> Result<Result<Answer, PostError>, StepError> {
        let streaming = call.request.get("stream").and_then(Value::as_bool) == Some(true);
        if !streaming {
            return Ok(self
                .provider
                .chat(
                    &call.key,
                    call.request,
                    &span.traceparent(),
                    &self.faults,
                    self.job_id(),
                )
                .await);
        }
        let renew = async {
            let every = Duration::from_millis((call.in_flight_ms / 3).max(100) as u64);
            loop {
                tokio::time::sleep(every).await;
                let slot = quota
                    .limited
                    .then_some((quota.limit_key.as_str(), quota.holder.as_str()));
                if let Err(e) = self
                    .store
                    .limits()
                    .renew_call(&call.key, self.fence.epoch, slot, call.in_flight_ms)
                    .await
                {
                    tracing::warn!(error = %e, key = call.key, "could not renew a streaming call's marks");
                }
            }
        };
        let traceparent = span.traceparent();
        let stream = Box::pin(self.stream_chat(
            &call.key,
            call.request,
            &traceparent,
            (&call.provider, &call.model),
        ));
        let (sent, chunks) = tokio::select! {
            streamed = stream => streamed?,
            () = renew => unreachable!("the renewal loop never ends"),
        };
        span.set(KeyValue::new(STREAM_CHUNKS, chunks as i64));
        Ok(sent)
    }

    /// Ends the call's slot: a throttled call teaches the learned window,
    /// and the tokens it cost beyond its estimate are charged to `tpm` (a
    /// refused call cost nothing, an answered one what its usage says).
    async fn release(&self, call: &Call<'_>, quota: &Quota, sent: &Result<Answer, PostError>) {
        let end = match sent {
            Ok(_) => CallEnd::Answered,
            Err(PostError::Failed(f)) => on_call_failure(f).call_end(),
            Err(PostError::Injected(_)) => CallEnd::Other,
        };
        if end == CallEnd::Throttled {
            let (provider, model) = self.limiter.limits().labels(&call.provider, &call.model);
            self.scope.metrics().throttled(provider, model);
            self.limiter.learn(&quota.limit_key);
        }
        let tokens_over = match (sent, end) {
            (_, CallEnd::Throttled) => -quota.estimate,
            (Ok((_, usage, _)), _) if quota.spec.tpm.is_some() => {
                match (usage.input_tokens, usage.output_tokens) {
                    (Some(i), Some(o)) => f64::from(i) + f64::from(o) - quota.estimate,
                    _ => 0.0,
                }
            }
            _ => 0.0,
        };
        if quota.limited || end == CallEnd::Throttled {
            if let Err(e) = self
                .store
                .limits()
                .end_call(
                    &quota.limit_key,
                    &quota.holder,
                    end,
                    quota.spec.concurrency,
                    tokens_over,
                )
                .await
            {
                // The slot lapses at its expiry; the window learns next time.
                tracing::warn!(error = %e, key = %quota.limit_key, "could not release a provider slot");
            }
        }
    }

    /// Journals the provider's answer (fenced), or fails the call for good
    /// when PostgreSQL could not store it.
    async fn record_answer(
        &self,
        call: &Call<'_>,
        attempt: i32,
        (response, usage, status): Answer,
        mut span: StepSpan,
    ) -> Result<(Value, Served), StepError> {
        let metrics = self.scope.metrics();
        let key = &call.key;
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
        if let Some(problem) = invalid_answer(&response, usage.input_tokens, usage.output_tokens) {
            // PostgreSQL would refuse to journal it (and, in a batch,
            // refuse its batchmates' rows with it): this job alone
            // fails, non-retryably, and the rest proceed.
            metrics.model_call(OUTCOME_FAILED);
            span.set(KeyValue::new(ERROR_CODE, "invalid_model_response"));
            span.end(OUTCOME_FAILED);
            let error = ErrorEnvelope {
                code: "invalid_model_response".into(),
                message: format!("the provider's answer to {key} cannot be journaled: {problem}"),
                retryable: false,
            };
            let failed = FailedSend {
                error: error.clone(),
                status: Some(i32::from(status)),
            };
            if !self
                .store
                .journal()
                .fail_model_call(&self.fence, key, &failed)
                .await?
            {
                return Err(StepError::LeaseLost);
            }
            return Err(StepError::Permanent {
                reason: format!("invalid model response ({key})"),
                error,
            });
        }
        match self
            .store
            .journal()
            .complete_model_call(
                &self.fence,
                key,
                &response,
                (usage.input_tokens, usage.output_tokens),
                &self.faults,
            )
            .await?
        {
            Checkpoint::Moved => {
                metrics.model_call(OUTCOME_PERFORMED);
                span.end(OUTCOME_PERFORMED);
                Ok((response, Served::Performed))
            }
            Checkpoint::Faulted => Err(StepError::Injected(crate::faults::Injected::Crash(
                crate::faults::FailPoint::BeforeCommit("model_call"),
            ))),
            Checkpoint::LeaseLost | Checkpoint::AlreadyAt(_) => Err(StepError::LeaseLost),
        }
    }

    /// Records why the call failed (fenced) and turns the verdict into the
    /// step's error: retry (after the server's `Retry-After`) or permanent.
    async fn record_failure(
        &self,
        call: &Call<'_>,
        attempt: i32,
        failure: PostError,
        mut span: StepSpan,
    ) -> Result<(Value, Served), StepError> {
        let metrics = self.scope.metrics();
        let failure = match failure {
            PostError::Injected(injected) => {
                // A failpoint after the send: to the engine, a lost answer.
                if matches!(injected, crate::faults::Injected::Fail(_)) {
                    metrics.model_call(OUTCOME_RETRIED);
                    span.end(OUTCOME_RETRIED);
                }
                return Err(injected.into());
            }
            PostError::Failed(failure) => failure,
        };
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
        let failed = FailedSend {
            error: error.clone(),
            status: failure.status().map(i32::from),
        };
        if !self
            .store
            .journal()
            .fail_model_call(&self.fence, &call.key, &failed)
            .await?
        {
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
                reason: format!("the model provider refused the request ({})", call.key),
                error: ErrorEnvelope {
                    retryable: false,
                    ..error
                },
            }
        })
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
    if crate::rules::payload::contains_nul(response) {
        return Some("it contains a NUL character (\\u0000)".into());
    }
    if input_tokens.is_some_and(|n| n < 0) || output_tokens.is_some_and(|n| n < 0) {
        return Some(format!(
            "negative token usage (input {input_tokens:?}, output {output_tokens:?})"
        ));
    }
    None
}
