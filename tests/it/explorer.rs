//! The crash-point explorer over the built-in workflows and the example user
//! workflow, and over two deliberately broken workflows it must catch.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use onceflow_engine::testkit::{wait_until, Explorer, FakeConsumer, Mode, Report, TestEnv};
use onceflow_engine::{Context, Registry, StepError, Workflow};
use onceflow_workflows::example::Onboarding;
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The boundaries each workflow's clean run passes, counted by hand from its
/// code, so a change of the lifecycle or of a workflow's steps changes these
/// on purpose. Completion: model-call send and journal (2), the commit of
/// generated, persisted and claimed (3 before, 3 after), the webhook send,
/// delivered (before and after), the ack and acked = 13. The agent: its
/// pinned tool set (a general step, 1), two turns' model calls (4), its
/// tool's effect (1) and the same 11 = 17. The
/// example: one model call (2), one general step (1) and the 11 = 14.
/// Streamed, a model call that streams text passes one more boundary,
/// mid-stream (`stream:chunk`): the agent's final turn streams its answer,
/// its tool-calling turn no text.
const COMPLETION_BOUNDARIES: usize = 13;
const STREAMED_AGENT_BOUNDARIES: usize = 18;
const AGENT_BOUNDARIES: usize = 17;
const EXAMPLE_BOUNDARIES: usize = 14;

/// Exactly `boundaries` explored, each in all three modes, every armed
/// failpoint fired, the clean run acked, and every invariant held.
fn assert_exploration(report: &Report, boundaries: usize) {
    assert_eq!(
        report.clean_state,
        Some(onceflow_engine::JobState::Acked),
        "{report}"
    );
    assert_eq!(report.boundaries.len(), boundaries, "{report}");
    assert_eq!(report.rows.len(), boundaries * 3, "{report}");
    for mode in [Mode::Crash, Mode::CrashNewNode, Mode::Freeze] {
        assert_eq!(
            report.rows.iter().filter(|r| r.mode == mode).count(),
            boundaries,
            "{mode:?}: {report}"
        );
    }
    assert!(report.rows.iter().all(|r| r.fired), "{report}");
    report.assert_ok();
}

fn prompt() -> Value {
    json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] })
}

#[actix_rt::test]
async fn completion_survives_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let report = Explorer::new(
        &env,
        || {
            let mut r = Registry::new();
            r.register(Completion::default());
            r
        },
        "completion",
        prompt(),
    )
    .run()
    .await;
    println!("{report}");
    assert_exploration(&report, COMPLETION_BOUNDARIES);
}

#[actix_rt::test]
async fn the_agent_survives_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "ticket": "X" }))]);
    let url = tools.url();
    let report = Explorer::new(
        &env,
        move || {
            let mut r = Registry::new();
            r.register(Agent::new().with_tool(HttpPost::new(url.clone())));
            r
        },
        "agent",
        prompt(),
    )
    .recording(tools)
    .run()
    .await;
    println!("{report}");
    assert!(report
        .rows
        .iter()
        .any(|r| r.boundary == onceflow_engine::FailPoint::ToolAfterEffect));
    assert_exploration(&report, AGENT_BOUNDARIES);
}

/// The agent asking a person before its tool call runs, with the approval
/// arriving while no node runs: a crash after the wait was journaled leaves
/// the job waiting, the approval makes it due with nobody listening, and the
/// resumed node runs the approved tool once.
#[actix_rt::test]
async fn an_approval_arriving_during_a_crash_runs_the_tool_once() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "ticket": "X" }))]);
    let url = tools.url();
    let mut input = prompt();
    input["approval"] = json!("all");
    let report = Explorer::new(
        &env,
        move || {
            let mut r = Registry::new();
            r.register(Agent::new().with_tool(HttpPost::new(url.clone())));
            r
        },
        "agent",
        input,
    )
    .signal("approval:call_1", "d-1", json!({ "approved": true }))
    .signals_arrive_during_crashes()
    .recording(tools)
    .run()
    .await;
    println!("{report}");
    let after_wait = onceflow_engine::FailPoint::AfterCommit("wait");
    for wait in [onceflow_engine::FailPoint::BeforeCommit("wait"), after_wait] {
        assert!(
            report.rows.iter().any(|r| r.boundary == wait && r.fired),
            "{wait}: {report}"
        );
    }
    assert!(report.rows.iter().all(|r| r.fired), "{report}");
    report.assert_ok();
    // In the rows crashed just after the wait was journaled, the approval
    // came after the wait (while no node ran); in the clean run's shape, before.
    let crashed_waiting: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.boundary == after_wait && r.mode != Mode::Freeze)
        .collect();
    assert_eq!(crashed_waiting.len(), 2, "{report}");
    for row in crashed_waiting {
        let order = env
            .sql(&format!(
                "SELECT (SELECT received_at FROM signals WHERE job_id = '{id}') \
                     > (SELECT created_at FROM waits WHERE job_id = '{id}') AS after",
                id = row.job_id
            ))
            .await;
        assert_eq!(order[0]["after"], true, "{}: {report}", row.job_id);
        // It waited, so it told its webhook so, once.
        let key = format!("job:{}:waiting:approval:call_1", row.job_id);
        assert!(
            wait_until(Duration::from_secs(10), || async {
                env.consumer.processed_with_key(&key) == 1
            })
            .await,
            "{key}: {} processed",
            env.consumer.processed_with_key(&key)
        );
    }
}

/// The agent with `"stream": true`: its tool call is assembled from a
/// stream, and a crash or takeover mid-way through the streamed final
/// answer resumes it without a repeat or a reset (the explorer compares
/// the stream journal with the clean run's).
#[actix_rt::test]
async fn the_streamed_agent_survives_every_boundary_and_mid_stream() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "ticket": "X" }))]);
    let url = tools.url();
    let mut input = prompt();
    input["stream"] = json!(true);
    let report = Explorer::new(
        &env,
        move || {
            let mut r = Registry::new();
            r.register(Agent::new().with_tool(HttpPost::new(url.clone())));
            r
        },
        "agent",
        input,
    )
    .recording(tools)
    .run()
    .await;
    println!("{report}");
    let mid_stream: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.boundary == onceflow_engine::FailPoint::StreamChunk)
        .collect();
    assert_eq!(mid_stream.len(), 3, "one mid-stream boundary, three modes");
    assert!(env.provider.stream_requests() > 0);
    assert_exploration(&report, STREAMED_AGENT_BOUNDARIES);
}

#[actix_rt::test]
async fn the_example_user_workflow_survives_every_boundary() {
    let env = TestEnv::new().await;
    let accounts = FakeConsumer::start();
    let url = accounts.url();
    let report = Explorer::new(
        &env,
        move || {
            let mut r = Registry::new();
            r.register(Onboarding::new(url.clone()));
            r
        },
        "example.onboarding",
        json!({ "email": "ada@example.com", "name": "Ada" }),
    )
    .recording(accounts)
    .run()
    .await;
    println!("{report}");
    assert!(report
        .rows
        .iter()
        .any(|r| r.boundary == onceflow_engine::FailPoint::StepAfterEffect));
    assert_exploration(&report, EXAMPLE_BOUNDARIES);
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Note {
    text: String,
}

/// Broken on purpose: its side effect's key comes from the attempt.
struct KeyFromAttempt {
    url: String,
}

impl Workflow for KeyFromAttempt {
    const NAME: &'static str = "broken.key_from_attempt";
    type Input = Note;
    type Output = Note;

    async fn run(&self, ctx: &mut Context, note: Note) -> Result<Note, StepError> {
        let key = format!("job:{}:notify:attempt-{}", ctx.job_id(), ctx.attempt());
        let sent = ctx
            .http()
            .post(&self.url)
            .header("idempotency-key", key)
            .json(&json!({ "job_id": ctx.job_id(), "text": note.text }))
            .send()
            .await;
        sent.map_err(|e| StepError::permanent("send", "could not notify", e.to_string()))?;
        Ok(note)
    }
}

/// Broken on purpose: "already sent?" is answered from memory, not by a constraint.
struct SentInMemory {
    url: String,
    sent: Mutex<HashSet<String>>,
}

impl Workflow for SentInMemory {
    const NAME: &'static str = "broken.sent_in_memory";
    type Input = Note;
    type Output = Note;

    async fn run(&self, ctx: &mut Context, note: Note) -> Result<Note, StepError> {
        let first = self.sent.lock().unwrap().insert(ctx.job_id().to_owned());
        if first {
            let sent = ctx
                .http()
                .post(&self.url)
                .json(&json!({ "job_id": ctx.job_id(), "text": note.text }))
                .send()
                .await;
            sent.map_err(|e| StepError::permanent("send", "could not notify", e.to_string()))?;
        }
        Ok(note)
    }
}

/// Broken on purpose: it runs its side effect as a journaled step, then
/// sends it once more under the step's own key, outside the step, on every
/// run. A replay of the job repeats a send whose outcome is journaled; the
/// recorder drops the repeat (same key, processed once), so only the
/// explorer's journal check can see it.
struct SentAgainOutsideItsStep {
    url: String,
}

impl Workflow for SentAgainOutsideItsStep {
    const NAME: &'static str = "broken.sent_again_outside_its_step";
    type Input = Note;
    type Output = Note;

    async fn run(&self, ctx: &mut Context, note: Note) -> Result<Note, StepError> {
        let body = json!({ "job_id": ctx.job_id(), "text": note.text });
        let url = self.url.clone();
        let key = ctx
            .step("notify", |step| {
                let body = body.clone();
                async move {
                    step.client
                        .post(&url)
                        .header("idempotency-key", &step.idempotency_key)
                        .json(&body)
                        .send()
                        .await
                        .map_err(|e| {
                            StepError::permanent("send", "could not notify", e.to_string())
                        })?;
                    Ok(step.idempotency_key)
                }
            })
            .await?;
        ctx.http()
            .post(&self.url)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await
            .map_err(|e| StepError::permanent("send", "could not confirm", e.to_string()))?;
        Ok(note)
    }
}

/// Explores a deliberately broken workflow that sends its side effect to a
/// recorder; the explorer must find at least one broken invariant.
async fn explore_broken<W: Workflow>(make: impl Fn(String) -> W + 'static) -> Report {
    let env = TestEnv::new().await;
    let recorder = FakeConsumer::start();
    let url = recorder.url();
    let registry = move || {
        let mut r = Registry::new();
        r.register(make(url.clone()));
        r
    };
    let report = Explorer::new(&env, registry, W::NAME, json!({ "text": "hello" }))
        .recording(recorder)
        .run()
        .await;
    println!("{report}");
    assert!(
        !report.failures().is_empty(),
        "the explorer missed {}:\n{report}",
        W::NAME
    );
    report
}

#[actix_rt::test]
async fn the_explorer_catches_a_key_derived_from_the_attempt() {
    let report = explore_broken(|url| KeyFromAttempt { url }).await;
    // Caught for the right reason: a resumed attempt repeated the effect
    // under a new key (two keys, or more when a slow machine lets a lease
    // lapse once more).
    assert!(
        report.failures().iter().all(|r| r.effect_requests > 1
            && r.violations.iter().any(|v| {
                v.contains("side effects under") && !v.contains("side effects under 1 keys")
            })),
        "{report}"
    );
}

#[actix_rt::test]
async fn the_explorer_catches_an_in_memory_already_sent_check() {
    let report = explore_broken(|url| SentInMemory {
        url,
        sent: Mutex::new(HashSet::new()),
    })
    .await;
    // Caught for the right reason: a node without the crashed node's memory
    // resumed the job and repeated the effect, which the recorder could not drop.
    let failures = report.failures();
    assert!(failures.iter().any(|r| r.mode == Mode::Crash), "{report}");
    assert!(
        failures.iter().all(|r| r.effect_requests > 1
            && r.violations.iter().any(|v| v.contains("processed 2 times"))),
        "{report}"
    );
}

#[actix_rt::test]
async fn the_explorer_catches_a_journaled_effect_sent_again() {
    let report = explore_broken(|url| SentAgainOutsideItsStep { url }).await;
    // Caught for the right reason, and only by the journal check: every
    // failing row is a crash after the step's journal commit, and the
    // recorder saw one key, processed once, as in the clean run.
    let failures = report.failures();
    assert!(
        failures.iter().all(|r| r.mode != Mode::Freeze
            && r.violations.len() == 1
            && r.violations[0].contains(":step:notify was journaled before the crash")),
        "{report}"
    );
}

/// Naps, then acts once through a recorded service.
struct Napper {
    service: String,
}

impl Workflow for Napper {
    const NAME: &'static str = "test.napper";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        ctx.sleep("nap", Duration::from_millis(300)).await?;
        let url = self.service.clone();
        ctx.step("act", |step| async move {
            step.post_json(&url, &json!({ "act": true })).await
        })
        .await?;
        Ok(json!({ "acted": true }))
    }
}

/// A timer at every boundary: crashed or taken over before the sleep is
/// journaled (it is asked again), after (the timer, already journaled,
/// fires once and is not slept again), and at every boundary after it, the
/// action after the timer is done once. The clean run's boundaries: the
/// wait (2), the step's effect (1) and the 11 of the lifecycle.
#[actix_rt::test]
async fn a_timer_survives_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let service = FakeConsumer::start();
    let url = service.url();
    let report = Explorer::new(
        &env,
        move || {
            let mut r = Registry::new();
            r.register(Napper {
                service: url.clone(),
            });
            r
        },
        Napper::NAME,
        json!({}),
    )
    .recording(service)
    .run()
    .await;
    println!("{report}");
    assert_exploration(&report, 14);
    for wait in ["before-commit:wait", "after-commit:wait"] {
        assert!(
            report.boundaries.iter().any(|(b, _)| b.to_string() == wait),
            "{wait}: {report}"
        );
    }
    let slept = env
        .sql(
            "SELECT count(*) AS n FROM waits WHERE wait_key LIKE '%:sleep:nap' AND outcome IS NULL",
        )
        .await;
    assert_eq!(slept[0]["n"], 0, "every timer fired: {slept}");
}
