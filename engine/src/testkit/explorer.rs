//! The crash-point explorer: proves a workflow survives a crash, or a stall
//! that lets a second worker take over, at every boundary it passes.
//!
//! 1. It runs one job to learn the workflow's boundaries (every failpoint the
//!    job passes, with how many times): in one attempt, plus one for each
//!    wait the job was released for (a timer, a signal not sent yet).
//! 2. For every boundary it runs a fresh job that crashes there twice over —
//!    the node restarted under the same name (it reclaims its jobs at once),
//!    and a new node with another name (it waits for the lease) — and
//!    another that freezes there past the lease (the other node takes over
//!    while the first attempt is still alive), on two nodes with separate
//!    memory. Every armed failpoint must fire; a job frozen unfinished
//!    must be taken over by another attempt, and the frozen one wake.
//! 3. It checks each job against the invariants, by counting: the job ended
//!    where the clean run ended; one distinct delivery key, processed once;
//!    every model call's work done once, under as many keys as the clean run;
//!    every side effect seen by the recorders processed once, under as many
//!    keys as the clean run; raw requests (model, webhook, effects) at most
//!    two more than the clean run's (one interrupted send repeated under its
//!    key, one more if a lease lapses on a busy machine); a history that is an in-order prefix of the lifecycle with no
//!    state skipped or repeated; a stream journal (what watchers were
//!    shown) with as many chunks and resets as the clean run's, since the
//!    fake provider replays a stream asked again under its key, whose text
//!    is each streamed call's journaled answer; and after a crash, no
//!    request at all under a key whose outcome the dead attempt had
//!    journaled (a model call answered, a tool call or step completed, a
//!    webhook recorded delivered). The clean
//!    run itself must end `acked`.
//!
//! ```no_run
//! # async fn example(env: onceflow_engine::testkit::TestEnv, effects: onceflow_engine::testkit::FakeConsumer) {
//! use onceflow_engine::testkit::Explorer;
//! let report = Explorer::new(&env, || my_registry(), "my.workflow", serde_json::json!({ "x": 1 }))
//!     .recording(effects)
//!     .run()
//!     .await;
//! println!("{report}");
//! report.assert_ok();
//! # }
//! # fn my_registry() -> onceflow_engine::Registry { unimplemented!() }
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use serde_json::Value;

use super::{FakeConsumer, TestEnv};
use crate::faults::{Action, FailPoint};
use crate::node::intake::NewJob;
use crate::rules::lifecycle::JobState;
use crate::workflow::Registry;

/// How a boundary is exercised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The attempt dies there and its node restarts under the same name,
    /// reclaiming the job at once.
    Crash,
    /// The attempt dies there and a new node (another name) resumes the job
    /// once the lease expires.
    CrashNewNode,
    /// The attempt freezes there past its lease: the other node takes over
    /// while it is alive; then it wakes up as a zombie.
    Freeze,
}

/// One boundary × mode and what the checks found.
#[derive(Debug, Clone)]
pub struct Row {
    /// The failpoint the job was stopped at.
    pub boundary: FailPoint,
    /// Which passage of the boundary (1 = the first).
    pub nth: u32,
    /// How it was stopped there.
    pub mode: Mode,
    /// The job explored.
    pub job_id: String,
    /// Where it ended (`None`: not found).
    pub state: Option<JobState>,
    /// Its attempt count at the end.
    pub attempts: i32,
    /// Raw requests the provider received for it.
    pub model_requests: usize,
    /// Raw requests the effect recorders received for it.
    pub effect_requests: usize,
    /// Raw webhook requests the consumer received for it.
    pub webhook_requests: usize,
    /// The armed failpoint fired.
    pub fired: bool,
    /// Broken invariants; empty when the row holds.
    pub violations: Vec<String>,
}

/// The explorer's findings.
#[derive(Debug, Clone)]
pub struct Report {
    /// The workflow explored.
    pub workflow: String,
    /// The boundaries the clean run passed (each explored in every mode).
    pub boundaries: Vec<(FailPoint, u32)>,
    /// Where the clean run ended.
    pub clean_state: Option<JobState>,
    /// Raw requests of the clean run: model, webhook, recorded effects.
    pub clean_requests: (usize, usize, usize),
    /// One row per boundary, passage and mode.
    pub rows: Vec<Row>,
}

impl Report {
    /// The rows that broke an invariant.
    pub fn failures(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| !r.violations.is_empty())
            .collect()
    }

    /// Panics with the table when any invariant broke.
    pub fn assert_ok(&self) {
        assert!(self.failures().is_empty(), "invariants broken:\n{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "crash-point explorer: {} ({} boundaries, {} runs; clean run {:?} with {} model, {} webhook, {} effect requests)",
            self.workflow,
            self.boundaries.len(),
            self.rows.len(),
            self.clean_state,
            self.clean_requests.0,
            self.clean_requests.1,
            self.clean_requests.2,
        )?;
        writeln!(
            f,
            "{:<28} {:<7} {:<10} {:>8} {:>6} {:>8} {:>8}  verdict",
            "boundary", "mode", "state", "attempts", "model", "effects", "webhook"
        )?;
        for r in &self.rows {
            let boundary = if r.nth > 1 {
                format!("{} #{}", r.boundary, r.nth)
            } else {
                r.boundary.to_string()
            };
            let state = r.state.map_or("?".to_owned(), |s| s.to_string());
            let verdict = if r.violations.is_empty() {
                "ok".to_owned()
            } else {
                r.violations.join("; ")
            };
            writeln!(
                f,
                "{boundary:<28} {:<7} {state:<10} {:>8} {:>6} {:>8} {:>8}  {verdict}",
                match r.mode {
                    Mode::Crash => "crash",
                    Mode::CrashNewNode => "crash+n",
                    Mode::Freeze => "freeze",
                },
                r.attempts,
                r.model_requests,
                r.effect_requests,
                r.webhook_requests
            )?;
        }
        Ok(())
    }
}

/// What one job did, counted.
#[derive(Debug, Clone, Default)]
struct Counts {
    state: Option<JobState>,
    attempts: i32,
    history: Vec<JobState>,
    model_keys: usize,
    model_requests: usize,
    /// The most requests one model-call key received.
    model_requests_per_key: usize,
    model_overworked: Vec<String>,
    effect_processed: usize,
    effect_keys: usize,
    effect_requests: usize,
    /// The most requests one side-effect key received.
    effect_requests_per_key: usize,
    webhook_keys: HashSet<Option<String>>,
    webhook_processed: usize,
    webhook_requests: usize,
    /// `job.waiting` events processed, and requested: the most for one
    /// wait (one event key).
    waiting_processed: usize,
    waiting_requests: usize,
    /// Chunks and resets in the job's stream journal (what watchers saw).
    stream_chunks: i64,
    stream_resets: i64,
    /// Streamed calls whose journaled text (latest generation) is not the
    /// answer journaled for the call.
    stream_differs: i64,
}

/// Explores one workflow with one input.
pub struct Explorer<'a, F> {
    env: &'a TestEnv,
    make_registry: F,
    workflow: String,
    input: Value,
    recorders: Vec<FakeConsumer>,
    /// Signals sent to each job right after it is submitted.
    signals: Vec<(String, String, Value)>,
    /// Whether a crashed job's signals are sent while no node runs instead.
    signals_in_crash: bool,
    prefix: String,
}

impl<'a, F: Fn() -> Registry> Explorer<'a, F> {
    /// `make_registry` is called once per node, so nodes share no memory.
    pub fn new(env: &'a TestEnv, make_registry: F, workflow: &str, input: Value) -> Self {
        Explorer {
            env,
            make_registry,
            workflow: workflow.to_owned(),
            input,
            recorders: Vec::new(),
            signals: Vec::new(),
            signals_in_crash: false,
            prefix: format!("x{}", rand::random::<u16>()),
        }
    }

    /// Sends every job it submits the signal `name` (id `signal_id`, this
    /// payload) right after submitting it (the job is scheduled a second
    /// later, so the signal is there before its wait): the job's wait takes
    /// it, however the job's attempts crash or freeze around the wait.
    pub fn signal(mut self, name: &str, signal_id: &str, payload: Value) -> Self {
        self.signals
            .push((name.to_owned(), signal_id.to_owned(), payload));
        self
    }

    /// In the crash rows, sends the [`signal`](Self::signal)s while no
    /// node runs, after the crash, instead of with the job: a crash after
    /// the wait was journaled leaves the job waiting, and the signal finds
    /// it so (its wake-up `NOTIFY` reaches nobody); the resumed node must
    /// still run it once. The clean run and the freeze rows get them with
    /// the job, as without this.
    pub fn signals_arrive_during_crashes(mut self) -> Self {
        self.signals_in_crash = true;
        self
    }

    /// Counts the side effects this recorder sees (tools, steps).
    pub fn recording(mut self, recorder: FakeConsumer) -> Self {
        self.recorders.push(recorder);
        self
    }

    /// Runs the exploration (inside an actix System).
    pub async fn run(self) -> Report {
        let env = self.env;
        let config = env.config();
        let lease = config.lease;
        let freeze = lease * 3;
        let wait = Duration::from_secs(30);
        let base = config.node_id.clone();
        let node = |name: &str| {
            let mut config = config.clone();
            config.node_id = format!("{base}-{name}");
            env.start((self.make_registry)(), config)
        };

        // 0. Warm up (connections, HTTP clients), so the clean run is clean.
        let first = node("clean");
        let warm = format!("{}-warm", self.prefix);
        self.submit(&warm).await;
        self.settle(&warm, wait).await;

        // 1. A clean run, recording the boundaries it passes.
        env.faults.record();
        let learn = format!("{}-learn", self.prefix);
        self.submit(&learn).await;
        let baseline = self.settle(&learn, wait).await;
        first.shutdown();
        // One attempt, and one more after each wait it was released for (a
        // timer not yet due, a signal not yet sent): the clean run to
        // compare with.
        let released = env
            .sql(&format!(
                "SELECT count(*) AS n FROM waits WHERE job_id = '{learn}' AND done_at > created_at"
            ))
            .await[0]["n"]
            .as_i64()
            .unwrap_or_default() as i32;
        assert_eq!(
            baseline.attempts,
            1 + released,
            "the clean run of {} needed {} attempts and waited {released} times; the explorer needs one clean run to compare with",
            self.workflow,
            baseline.attempts
        );
        assert_eq!(
            baseline.state,
            Some(JobState::Acked),
            "the clean run of {} did not end acked",
            self.workflow
        );
        let mut boundaries: Vec<(FailPoint, u32)> = Vec::new();
        let mut seen: BTreeMap<String, u32> = BTreeMap::new();
        for (job, point) in env.faults.hits() {
            if job == learn {
                let n = seen.entry(point.to_string()).or_default();
                *n += 1;
                boundaries.push((point, *n));
            }
        }

        // 2. Every boundary crashed: the node dies there and either restarts
        //    under the same name (it reclaims its jobs at once) or a new
        //    node, with another name, resumes the job once the lease
        //    expires; neither has the old node's memory.
        let mut rows = Vec::new();
        for mode in [Mode::Crash, Mode::CrashNewNode] {
            for (i, (point, nth)) in boundaries.iter().enumerate() {
                let id = format!(
                    "{}-{i}-{}",
                    self.prefix,
                    if mode == Mode::Crash { "c" } else { "n" }
                );
                env.faults.arm_nth(&id, *point, Action::Crash, *nth);
                let crashing = node("crashing");
                self.submit_with(&id, !self.signals_in_crash).await;
                if self.signals_in_crash {
                    // A boundary past the wait is reached only once the
                    // signal is there: send it while the node runs when the
                    // job waits for it before reaching the armed boundary.
                    super::wait_until(wait, || async {
                        env.faults.fired(&id) || self.is_waiting(&id).await
                    })
                    .await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if !env.faults.fired(&id) {
                        self.send_signals(&id).await;
                    }
                }
                let fired = super::wait_until(wait, || async { env.faults.fired(&id) }).await;
                crashing.shutdown();
                if self.signals_in_crash {
                    self.send_signals(&id).await;
                }
                // What the dead attempt had journaled is never asked for again.
                let journaled = self.journaled(&id).await;
                let resumed_at = std::time::Instant::now();
                let resumed = node(if mode == Mode::Crash {
                    "crashing"
                } else {
                    "resuming"
                });
                let counts = self.settle(&id, wait).await;
                resumed.shutdown();
                let mut row = row(*point, *nth, mode, &id, fired, &baseline, &counts);
                row.violations
                    .extend(self.asked_again(&journaled, resumed_at));
                rows.push(row);
            }
        }

        // 3. Every boundary frozen past the lease, with two nodes of separate
        //    memory: a frozen node stands for a paused process and takes no
        //    work, so the other node takes the job over while the first
        //    attempt is alive; then the first wakes up as a zombie.
        let (a, b) = (node("a"), node("b"));
        for (i, (point, nth)) in boundaries.iter().enumerate() {
            let id = format!("{}-{i}-f", self.prefix);
            env.faults
                .arm_nth(&id, *point, Action::Freeze(freeze), *nth);
            self.submit(&id).await;
            // Frozen with its job unfinished, the attempt must be taken over:
            // the job can then only end by another attempt.
            let frozen_live = super::wait_until(wait, || async { env.faults.fired(&id) }).await
                && env
                    .store
                    .jobs()
                    .get(&id)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|j| !j.state.is_terminal());
            let settled = self.settle(&id, wait).await;
            // Ended while the attempt was still frozen: it went on without
            // it (taken over, or released into a wait it had journaled).
            let ended_while_frozen =
                env.faults.is_frozen(&id) && settled.state.is_some_and(|s| s.is_terminal());
            // What the attempt that took over journaled: the zombie must
            // send none of it again.
            let journaled = self.journaled(&id).await;
            let settled_at = std::time::Instant::now();
            // Let the zombie wake up and try whatever it was about to do.
            let woke = super::wait_until(wait, || async { !env.faults.any_frozen() }).await;
            tokio::time::sleep(lease).await;
            let counts = self.count(&id).await;
            let fired = env.faults.fired(&id);
            let mut row = row(*point, *nth, Mode::Freeze, &id, fired, &baseline, &counts);
            row.violations
                .extend(self.asked_again(&journaled, settled_at));
            if frozen_live && !ended_while_frozen && counts.attempts < baseline.attempts + 1 {
                row.violations.push(format!(
                    "frozen with the job unfinished, yet no other attempt took it over ({} attempt)",
                    counts.attempts
                ));
            }
            if !woke {
                row.violations
                    .push("the frozen attempt never woke up".to_owned());
            }
            rows.push(row);
        }
        a.shutdown();
        b.shutdown();
        Report {
            workflow: self.workflow,
            boundaries,
            clean_state: baseline.state,
            clean_requests: (
                baseline.model_requests,
                baseline.webhook_requests,
                baseline.effect_requests,
            ),
            rows,
        }
    }

    async fn submit(&self, id: &str) {
        self.submit_with(id, true).await;
    }

    async fn submit_with(&self, id: &str, with_signals: bool) {
        // The version a node with this registry would start it on.
        let version = (self.make_registry)()
            .get(&self.workflow)
            .map_or(1, |w| w.version() as i32);
        self.env
            .submit_job(NewJob {
                tags: Default::default(),
                id: id.to_owned(),
                workflow: self.workflow.clone(),
                workflow_version: version,
                input: self.input.clone(),
                webhook_url: self.env.consumer.url(),
                // With signals to send, the job starts a second later, so
                // its wait finds them recorded: one attempt, as the clean
                // run needs.
                schedule: crate::node::intake::Schedule {
                    delay_ms: (!self.signals.is_empty()).then_some(1_000),
                    ..Default::default()
                },
            })
            .await;
        if with_signals {
            self.send_signals(id).await;
        }
    }

    async fn send_signals(&self, id: &str) {
        for (name, signal_id, payload) in &self.signals {
            self.env
                .store
                .waits()
                .signal(
                    id,
                    name,
                    &crate::rules::signal::SignalBody::new(signal_id, payload.clone()),
                )
                .await
                .expect("send the explorer's signal");
        }
    }

    async fn is_waiting(&self, id: &str) -> bool {
        self.env
            .store
            .jobs()
            .get(id)
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.waiting.is_some())
    }

    /// Waits until the job is finished (or `wait` passes), then counts.
    async fn settle(&self, id: &str, wait: Duration) -> Counts {
        super::wait_until(wait, || async {
            self.env
                .store
                .jobs()
                .get(id)
                .await
                .ok()
                .flatten()
                .is_some_and(|j| j.state.is_terminal())
        })
        .await;
        self.count(id).await
    }

    /// The keys of `id`'s side effects whose outcome is journaled: model
    /// calls answered, tool calls and steps completed, webhooks recorded
    /// delivered.
    async fn journaled(&self, id: &str) -> Vec<String> {
        let rows = self
            .env
            .sql(&format!(
                "SELECT idempotency_key AS key FROM model_calls \
                     WHERE job_id = '{id}' AND status = 'completed' \
                 UNION ALL SELECT 'job:' || job_id || ':tool:' || turn || ':' || call_index \
                     FROM tool_calls WHERE job_id = '{id}' AND status = 'completed' \
                 UNION ALL SELECT step_key FROM steps WHERE job_id = '{id}' \
                 UNION ALL SELECT idempotency_key FROM outbox \
                     WHERE job_id = '{id}' AND status = 'delivered'",
                id = id.replace('\'', "''")
            ))
            .await;
        rows.as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["key"].as_str().map(str::to_owned))
            .collect()
    }

    /// One violation per journaled key that the provider, the webhook
    /// consumer or a recorder received again after `since`.
    fn asked_again(&self, journaled: &[String], since: std::time::Instant) -> Vec<String> {
        let env = self.env;
        let is = |key: &Option<String>, wanted: &str| key.as_deref() == Some(wanted);
        journaled
            .iter()
            .filter_map(|key| {
                let model = env
                    .provider
                    .requests()
                    .iter()
                    .filter(|r| r.received_at > since && is(&r.idempotency_key, key))
                    .count();
                let sent = std::iter::once(&env.consumer)
                    .chain(&self.recorders)
                    .flat_map(|c| c.deliveries())
                    .filter(|d| d.received_at > since && is(&d.idempotency_key, key))
                    .count();
                (model + sent > 0).then(|| {
                    format!(
                        "{key} was journaled before the crash, yet sent again {} times",
                        model + sent
                    )
                })
            })
            .collect()
    }

    async fn count(&self, id: &str) -> Counts {
        let env = self.env;
        let prefix = format!("job:{id}:");
        let mut c = Counts::default();
        if let Some(job) = env.store.jobs().get(id).await.ok().flatten() {
            c.state = Some(job.state);
            c.attempts = job.attempts;
            c.history = job.history.iter().map(|h| h.state).collect();
        }
        let model_keys: HashSet<String> = env
            .provider
            .requests()
            .into_iter()
            .filter_map(|r| r.idempotency_key)
            .filter(|k| k.starts_with(&prefix))
            .collect();
        c.model_requests = env
            .provider
            .requests()
            .iter()
            .filter(|r| {
                r.idempotency_key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(&prefix))
            })
            .count();
        c.model_requests_per_key = model_keys
            .iter()
            .map(|k| env.provider.requests_for(k))
            .max()
            .unwrap_or(0);
        c.model_overworked = model_keys
            .iter()
            .filter(|k| env.provider.work_done(k) != 1)
            .cloned()
            .collect();
        c.model_keys = model_keys.len();
        for recorder in &self.recorders {
            let mine: Vec<_> = recorder
                .deliveries()
                .into_iter()
                .filter(|d| {
                    d.idempotency_key
                        .as_deref()
                        .is_some_and(|k| k.starts_with(&prefix))
                        || super::consumer::job_of(&d.body) == Some(id)
                })
                .collect();
            c.effect_requests += mine.len();
            c.effect_processed += mine
                .iter()
                .filter(|d| !d.duplicate && (200..300).contains(&d.status))
                .count();
            let mut per_key: HashMap<String, usize> = HashMap::new();
            for d in &mine {
                let key = d
                    .idempotency_key
                    .clone()
                    .unwrap_or_else(|| format!("(none) {}", d.received));
                *per_key.entry(key).or_default() += 1;
            }
            c.effect_keys += per_key.len();
            c.effect_requests_per_key = c
                .effect_requests_per_key
                .max(per_key.values().copied().max().unwrap_or(0));
        }
        let journal = env
            .sql(&format!(
                "SELECT count(*) FILTER (WHERE kind = 'chunk') AS chunks, \
                 count(*) FILTER (WHERE kind = 'reset') AS resets, \
                 (SELECT count(*) FROM ( \
                     SELECT e.call_key, string_agg(e.text, '' ORDER BY e.id) AS shown \
                     FROM stream_events e WHERE e.job_id = '{id}' AND e.kind = 'chunk' \
                       AND e.generation = (SELECT max(g.generation) FROM stream_events g \
                           WHERE g.job_id = e.job_id AND g.call_key = e.call_key) \
                     GROUP BY e.call_key) s \
                   JOIN model_calls m ON m.idempotency_key = s.call_key \
                   WHERE m.response IS NOT NULL \
                     AND s.shown IS DISTINCT FROM m.response->'choices'->0->'message'->>'content' \
                 ) AS differ \
                 FROM stream_events WHERE job_id = '{id}'",
                id = id.replace('\'', "''")
            ))
            .await;
        c.stream_chunks = journal[0]["chunks"].as_i64().unwrap_or_default();
        c.stream_resets = journal[0]["resets"].as_i64().unwrap_or_default();
        c.stream_differs = journal[0]["differ"].as_i64().unwrap_or_default();
        // A `job.waiting` event (a job that waited for a signal the clean
        // run found there already) is counted apart: once per wait.
        let (waiting, hooks): (Vec<_>, Vec<_>) =
            env.consumer.deliveries_for(id).into_iter().partition(|d| {
                d.webhook_id
                    .as_deref()
                    .is_some_and(|k| k.contains(":waiting:"))
            });
        let processed = |d: &&super::Delivery| !d.duplicate && (200..300).contains(&d.status);
        c.webhook_requests = hooks.len();
        c.webhook_keys = hooks.iter().map(|d| d.webhook_id.clone()).collect();
        c.webhook_processed = hooks.iter().filter(processed).count();
        let mut per_wait: HashMap<Option<String>, (usize, usize)> = HashMap::new();
        for d in &waiting {
            let counts = per_wait.entry(d.webhook_id.clone()).or_default();
            counts.0 += usize::from(processed(&d));
            counts.1 += 1;
        }
        c.waiting_processed = per_wait.values().map(|n| n.0).max().unwrap_or(0);
        c.waiting_requests = per_wait.values().map(|n| n.1).max().unwrap_or(0);
        c
    }
}

fn row(
    boundary: FailPoint,
    nth: u32,
    mode: Mode,
    id: &str,
    fired: bool,
    baseline: &Counts,
    c: &Counts,
) -> Row {
    let mut violations = violations(baseline, c, mode);
    if !fired {
        violations.push("the armed failpoint never fired".to_owned());
    }
    Row {
        boundary,
        nth,
        mode,
        job_id: id.to_owned(),
        state: c.state,
        attempts: c.attempts,
        model_requests: c.model_requests,
        effect_requests: c.effect_requests,
        webhook_requests: c.webhook_requests,
        fired,
        violations,
    }
}

/// The invariants, checked against the clean run.
fn violations(baseline: &Counts, c: &Counts, mode: Mode) -> Vec<String> {
    let mut v = Vec::new();
    if c.state != baseline.state {
        v.push(format!(
            "ended {:?}, the clean run ended {:?}",
            c.state, baseline.state
        ));
    }
    if baseline.webhook_processed > 0 {
        if c.webhook_keys.len() != 1 {
            v.push(format!("{} distinct delivery keys", c.webhook_keys.len()));
        }
        if c.webhook_processed != baseline.webhook_processed {
            v.push(format!("webhook processed {} times", c.webhook_processed));
        }
    }
    if c.waiting_processed > 1 {
        v.push(format!(
            "job.waiting processed {} times for one wait",
            c.waiting_processed
        ));
    }
    if !c.model_overworked.is_empty() {
        v.push(format!(
            "model work repeated under {:?}",
            c.model_overworked
        ));
    }
    if c.model_keys != baseline.model_keys {
        v.push(format!(
            "{} model-call keys, the clean run used {}",
            c.model_keys, baseline.model_keys
        ));
    }
    if c.effect_processed != baseline.effect_processed {
        v.push(format!(
            "side effects processed {} times, the clean run {}",
            c.effect_processed, baseline.effect_processed
        ));
    }
    if c.effect_keys != baseline.effect_keys {
        v.push(format!(
            "side effects under {} keys, the clean run {}",
            c.effect_keys, baseline.effect_keys
        ));
    }
    // One interrupted send may be repeated under its key, and after a
    // crash on a busy machine one more if a 1 s lease lapses once in the
    // takeover; never more. A frozen attempt that wakes sends nothing the
    // attempt that took over sent (checked by key too, above): one repeat.
    let slack = if mode == Mode::Freeze { 1 } else { 2 };
    // Model calls are counted per key: a crash interrupts every call in
    // flight (several, with `generate_all`), and each may be sent again
    // under its own key; none more than the slack.
    if c.model_requests_per_key > baseline.model_requests_per_key + slack {
        v.push(format!(
            "{} requests under one model-call key, the clean run sent {}",
            c.model_requests_per_key, baseline.model_requests_per_key
        ));
    }
    // Side effects likewise: a crash interrupts every step of a
    // `step_all` in flight, each resent under its own key.
    if c.effect_requests_per_key > baseline.effect_requests_per_key + slack {
        v.push(format!(
            "{} requests under one side-effect key, the clean run sent {}",
            c.effect_requests_per_key, baseline.effect_requests_per_key
        ));
    }
    let effect_slack = slack * baseline.effect_keys.max(1);
    if c.effect_requests > baseline.effect_requests + effect_slack {
        v.push(format!(
            "{} side-effect requests, the clean run sent {}",
            c.effect_requests, baseline.effect_requests
        ));
    }
    for (what, clean, now) in [
        ("webhook", baseline.webhook_requests, c.webhook_requests),
        // At most one job.waiting per wait, so one and its resends.
        ("job.waiting", 1, c.waiting_requests),
    ] {
        if now > clean + slack {
            v.push(format!("{now} {what} requests, the clean run sent {clean}"));
        }
    }
    // A stream asked again under its key is replayed by the fake provider,
    // so watchers must see it neither repeated nor reset.
    if (c.stream_chunks, c.stream_resets) != (baseline.stream_chunks, baseline.stream_resets) {
        v.push(format!(
            "the stream journal holds {} chunks and {} resets, the clean run's {} and {}",
            c.stream_chunks, c.stream_resets, baseline.stream_chunks, baseline.stream_resets
        ));
    }
    if c.stream_differs > 0 {
        v.push(format!(
            "{} streamed calls show text that is not their journaled answer",
            c.stream_differs
        ));
    }
    if !is_lifecycle_prefix(&c.history) {
        v.push(format!("history {:?} skips or repeats a state", c.history));
    }
    v
}

/// `received, generated, …` in order with nothing skipped or repeated, possibly ending in `dead`.
fn is_lifecycle_prefix(history: &[JobState]) -> bool {
    let live: &[JobState] = match history.split_last() {
        Some((JobState::Dead, rest)) => rest,
        _ => history,
    };
    !live.is_empty()
        && live.iter().zip(JobState::ALL.iter()).all(|(a, b)| a == b)
        && live.len() <= 6
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    #[test]
    fn lifecycle_prefixes() {
        assert!(is_lifecycle_prefix(&[
            Received, Generated, Persisted, Claimed, Delivered, Acked
        ]));
        assert!(is_lifecycle_prefix(&[Received, Dead]));
        assert!(is_lifecycle_prefix(&[
            Received, Generated, Persisted, Claimed, Dead
        ]));
        assert!(!is_lifecycle_prefix(&[Received, Persisted]));
        assert!(!is_lifecycle_prefix(&[Received, Generated, Generated]));
        assert!(!is_lifecycle_prefix(&[]));
        assert!(!is_lifecycle_prefix(&[Generated]));
    }
}
