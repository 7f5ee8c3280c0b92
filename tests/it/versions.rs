//! Changing a workflow while its jobs are in flight. A job records the
//! version it started on and runs only on it: after a deploy that registers
//! v2 beside v1, jobs caught mid-way finish on v1 (their journal replays,
//! no model call repeats) and new jobs start on v2. A body changed *without*
//! a new version fails loudly when its rerun no longer matches the journal,
//! instead of paying for the model again.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{Context, JobState, Registry, StepError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::support::{post_job, serve_api};

const WAIT: Duration = Duration::from_secs(20);

#[derive(Deserialize)]
struct EssayInput {
    topic: String,
}

#[derive(Serialize)]
struct EssayOutput {
    version: u32,
    text: String,
}

fn ask(prompt: String) -> Value {
    json!({ "model": "m", "messages": [{ "role": "user", "content": prompt }] })
}

fn text(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// v1: a draft, then a `publish` step (the crash point sits after it).
struct EssayV1 {
    published: Arc<AtomicU32>,
}

impl Workflow for EssayV1 {
    const NAME: &'static str = "test.essay";
    type Input = EssayInput;
    type Output = EssayOutput;

    async fn run(&self, ctx: &mut Context, input: EssayInput) -> Result<EssayOutput, StepError> {
        let draft = ctx
            .generate("draft", &ask(format!("draft on {}", input.topic)))
            .await?;
        let published = self.published.clone();
        ctx.step("publish", |_| async move {
            Ok(published.fetch_add(1, Ordering::SeqCst))
        })
        .await?;
        Ok(EssayOutput {
            version: 1,
            text: text(&draft),
        })
    }
}

/// v2: an outline first, then a draft from it.
struct EssayV2;

impl Workflow for EssayV2 {
    const NAME: &'static str = "test.essay";
    const VERSION: u32 = 2;
    type Input = EssayInput;
    type Output = EssayOutput;

    async fn run(&self, ctx: &mut Context, input: EssayInput) -> Result<EssayOutput, StepError> {
        let outline = ctx
            .generate("outline", &ask(format!("outline on {}", input.topic)))
            .await?;
        let draft = ctx
            .generate("draft", &ask(format!("draft from {}", text(&outline))))
            .await?;
        Ok(EssayOutput {
            version: 2,
            text: text(&draft),
        })
    }
}

/// v2's body deployed as version 1: the mistake the journal check catches.
struct EssayChangedInPlace;

impl Workflow for EssayChangedInPlace {
    const NAME: &'static str = "test.essay";
    type Input = EssayInput;
    type Output = EssayOutput;

    async fn run(&self, ctx: &mut Context, input: EssayInput) -> Result<EssayOutput, StepError> {
        EssayV2.run(ctx, input).await
    }
}

fn v1_only(published: &Arc<AtomicU32>) -> Registry {
    let mut r = Registry::new();
    r.register(EssayV1 {
        published: published.clone(),
    });
    r
}

/// Starts jobs `ids` on a v1-only node and crashes each right after its
/// `publish` step ran (its draft journaled, the step's output not), then
/// shuts the node down: the jobs are mid-way, leased to a dead node.
async fn crash_mid_way(env: &TestEnv, published: &Arc<AtomicU32>, ids: &[&str]) {
    for id in ids {
        env.faults
            .arm_once(id, FailPoint::StepAfterEffect, Action::Crash);
    }
    let old = env.start(v1_only(published), env.config());
    let base = serve_api(env, v1_only(published), None);
    for id in ids {
        let (status, body) = post_job(
            &base,
            &json!({ "id": id, "workflow": "test.essay", "input": { "topic": id },
                     "webhook_url": env.consumer.url() }),
        )
        .await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["workflow_version"], 1, "{body}");
    }
    let crashed = wait_until(WAIT, || async { ids.iter().all(|id| env.faults.fired(id)) }).await;
    assert!(crashed, "every job crashed after its publish step");
    old.shutdown();
    for id in ids {
        let job = env.job(id).await;
        assert_eq!(job.state, JobState::Received, "mid-way: {id}");
        assert_eq!(env.provider.requests_for(&format!("job:{id}:draft")), 1);
    }
}

#[actix_rt::test]
async fn in_flight_jobs_finish_on_their_version_and_new_jobs_start_on_the_new_one() {
    let env = TestEnv::new().await;
    let published = Arc::new(AtomicU32::new(0));
    let old_jobs = ["essay-a", "essay-b", "essay-c"];
    crash_mid_way(&env, &published, &old_jobs).await;

    // The deploy: v2 registered beside v1.
    let mut both = v1_only(&published);
    both.register(EssayV2);
    let _new = env.start(both.clone(), env.config());
    let base = serve_api(&env, both, None);
    let new_jobs = ["essay-x", "essay-y"];
    for id in new_jobs {
        let (status, body) = post_job(
            &base,
            &json!({ "id": id, "workflow": "test.essay", "input": { "topic": id },
                     "webhook_url": env.consumer.url() }),
        )
        .await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["workflow_version"], 2, "new jobs start on v2: {body}");
    }
    for id in old_jobs {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert_eq!(job.workflow_version, 1);
        assert!(job.attempts >= 2, "{id} was resumed, not run once");
        assert_eq!(job.result.as_ref().unwrap()["version"], 1, "{id} ran v1");
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:draft")),
            1,
            "{id}: the draft replayed from the journal"
        );
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:outline")),
            0,
            "{id}: v2's step never ran on a v1 job"
        );
        assert_eq!(env.consumer.deliveries_for(id).len(), 1);
    }
    for id in new_jobs {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert_eq!(job.workflow_version, 2);
        assert_eq!(job.result.as_ref().unwrap()["version"], 2, "{id} ran v2");
        for step in ["outline", "draft"] {
            assert_eq!(env.provider.requests_for(&format!("job:{id}:{step}")), 1);
        }
    }
    // An identical resubmission of a v1 job after the deploy is the same request.
    let (status, body) = post_job(
        &base,
        &json!({ "id": "essay-a", "workflow": "test.essay", "input": { "topic": "essay-a" },
                 "webhook_url": env.consumer.url() }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["workflow_version"], 1, "{body}");
}

#[actix_rt::test]
async fn a_node_without_a_jobs_version_leaves_the_job_to_nodes_that_have_it() {
    let env = TestEnv::new().await;
    let published = Arc::new(AtomicU32::new(0));
    // A v2 job (submitted through a node that has v2), first in line...
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "needs-v2".into(),
        workflow: "test.essay".into(),
        workflow_version: 2,
        input: json!({ "topic": "t" }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    // ...and a v1 job behind it, on a node that has only v1.
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "has-v1".into(),
        workflow: "test.essay".into(),
        workflow_version: 1,
        input: json!({ "topic": "t" }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let old = env.start(v1_only(&published), env.config());
    env.wait_for("has-v1", JobState::Acked, WAIT).await;
    let waiting = env.job("needs-v2").await;
    assert_eq!(waiting.state, JobState::Received);
    assert_eq!(waiting.attempts, 0, "the v1 node never leased it");
    assert_eq!(env.provider.requests_for("job:needs-v2:outline"), 0);
    assert_eq!(env.provider.requests_for("job:needs-v2:draft"), 0);
    old.shutdown();

    let mut both = v1_only(&published);
    both.register(EssayV2);
    let _new = env.start(both, env.config());
    let job = env.wait_for("needs-v2", JobState::Acked, WAIT).await;
    assert_eq!(job.result.as_ref().unwrap()["version"], 2);
}

#[actix_rt::test]
async fn a_body_changed_under_the_same_version_fails_loudly_instead_of_paying_again() {
    let env = TestEnv::new().await;
    let published = Arc::new(AtomicU32::new(0));
    crash_mid_way(&env, &published, &["changed-1"]).await;

    let mut changed = Registry::new();
    changed.register(EssayChangedInPlace);
    let _new = env.start(changed, env.config());
    let job = env.wait_for("changed-1", JobState::Dead, WAIT).await;
    let error = job.last_error.as_ref().expect("an error");
    assert_eq!(error.code, "journal_mismatch", "{error:?}");
    assert!(!error.retryable);
    let reason = job.dead_reason.as_deref().unwrap_or_default();
    for named in [
        "\"outline\"",
        "job:changed-1:outline",
        "job:changed-1:draft",
    ] {
        assert!(reason.contains(named), "{named} in {reason:?}");
    }
    assert_eq!(
        env.provider.requests_for("job:changed-1:outline"),
        0,
        "the new step was never sent"
    );
    assert_eq!(env.provider.requests_for("job:changed-1:draft"), 1);
    assert_eq!(env.consumer.deliveries_for("changed-1").len(), 0);
}

/// A body that goes on past a failed step (whose output is therefore never
/// journaled), then calls the model.
struct Tolerant;

impl Workflow for Tolerant {
    const NAME: &'static str = "test.tolerant";
    type Input = EssayInput;
    type Output = EssayOutput;

    async fn run(&self, ctx: &mut Context, input: EssayInput) -> Result<EssayOutput, StepError> {
        // Goes on past the service's own failure only; any other error
        // (the engine's) ends the body.
        let enriched: Option<String> = match ctx
            .step("enrich", |_| async {
                Err::<String, _>(StepError::permanent(
                    "unavailable",
                    "the enrichment service is down",
                    "down",
                ))
            })
            .await
        {
            Ok(v) => Some(v),
            Err(e) if e.envelope().code == "unavailable" => None,
            Err(e) => return Err(e),
        };
        let answer = ctx
            .generate(
                "answer",
                &ask(format!("{} {}", input.topic, enriched.unwrap_or_default())),
            )
            .await?;
        Ok(EssayOutput {
            version: 1,
            text: text(&answer),
        })
    }
}

#[actix_rt::test]
async fn a_failed_step_the_body_went_past_is_not_a_journal_mismatch() {
    let env = TestEnv::new().await;
    // The first attempt crashes after the body returned, its answer journaled.
    env.faults.arm_once(
        "tolerant-1",
        FailPoint::BeforeCommit("generated"),
        Action::Crash,
    );
    let mut registry = Registry::new();
    registry.register(Tolerant);
    let _engine = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "tolerant-1".into(),
        workflow: "test.tolerant".into(),
        workflow_version: 1,
        input: json!({ "topic": "t" }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("tolerant-1", JobState::Acked, WAIT).await;
    assert!(env.faults.fired("tolerant-1"));
    assert!(job.attempts >= 2, "the rerun replayed the journal");
    assert_eq!(env.provider.requests_for("job:tolerant-1:answer"), 1);
    assert_eq!(env.consumer.processed_for("tolerant-1"), 1);
}

/// Waits for the signal `go`, then ends.
struct Gate;

impl Workflow for Gate {
    const NAME: &'static str = "test.gate";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let go: Option<Value> = ctx.wait_for_signal("go", WAIT * 6).await?;
        Ok(json!({ "go": go }))
    }
}

/// The same workflow and version, changed in place: it naps first, then
/// waits for `proceed` instead.
struct GateChangedInPlace;

impl Workflow for GateChangedInPlace {
    const NAME: &'static str = "test.gate";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        ctx.sleep("nap", Duration::from_millis(1)).await?;
        let go: Option<Value> = ctx.wait_for_signal("proceed", WAIT * 6).await?;
        Ok(json!({ "go": go }))
    }
}

/// A job resumed from its wait by a body whose waits no longer match its
/// journal ends as `journal_mismatch`, naming the wait it journaled; the
/// new body's wait is never journaled.
#[actix_rt::test]
async fn a_wait_the_changed_body_no_longer_makes_is_a_journal_mismatch() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(Gate);
    let first = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "gate-1".into(),
        workflow: Gate::NAME.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    assert!(
        wait_until(WAIT, || async { env.job("gate-1").await.waiting.is_some() }).await,
        "gate-1 never waited"
    );
    first.shutdown_gracefully().await.unwrap();
    drop(first);

    let mut changed = Registry::new();
    changed.register(GateChangedInPlace);
    let _second = env.start(changed, env.config());
    env.store
        .waits()
        .signal(
            "gate-1",
            "go",
            &onceflow_engine::rules::signal::SignalBody::new("s-1", json!(1)),
        )
        .await
        .unwrap();
    let job = env.wait_for("gate-1", JobState::Dead, WAIT).await;
    let error = job.last_error.as_ref().expect("an error");
    assert_eq!(error.code, "journal_mismatch", "{error:?}");
    let reason = job.dead_reason.as_deref().unwrap_or_default();
    assert!(reason.contains("job:gate-1:signal:go"), "{reason:?}");
    let waits = env
        .sql("SELECT wait_key FROM waits WHERE job_id = 'gate-1' ORDER BY created_at")
        .await;
    assert_eq!(waits, json!([{ "wait_key": "job:gate-1:signal:go" }]));
}
