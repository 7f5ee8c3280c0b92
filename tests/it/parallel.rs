//! Parallel calls inside one job (`ctx.generate_all`): each call journaled
//! under its own key, sent at once, replayed after a crash, and admitted
//! one by one by the provider limits.

use std::time::Duration;

use onceflow_engine::node::intake::NewJob;
use onceflow_engine::rules::quota::Limits;
use onceflow_engine::testkit::{Explorer, TestEnv};
use onceflow_engine::{Context, JobState, Registry, StepError, Workflow};
use serde_json::{json, Value};

/// Asks three models at once, then a fourth judges.
pub(crate) struct Panel;

impl Workflow for Panel {
    const NAME: &'static str = "test.panel";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        // One model, three framings (a provider limit is per model).
        let ask = |framing: &str| {
            let question = format!("{framing}: capital of France?");
            json!({ "model": "m", "messages": [{ "role": "user", "content": question }] })
        };
        let (a, b, c) = (ask("terse"), ask("careful"), ask("skeptical"));
        let answers = ctx
            .generate_all(&[("panel-a", &a), ("panel-b", &b), ("panel-c", &c)])
            .await?;
        let judge = json!({ "model": "judge", "messages": [{ "role": "user", "content": answers.len().to_string() }] });
        ctx.generate("judge", &judge).await?;
        Ok(json!({ "answers": answers.len() }))
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Panel);
    r
}

async fn submit(env: &TestEnv, id: &str) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: Panel::NAME.to_owned(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// The three calls are in flight together; with a provider limit of one
/// at a time they go one by one, and every key is paid once either way.
#[actix_rt::test]
async fn parallel_calls_go_at_once_within_the_provider_limits() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(400));
    let engine = env.start(registry(), env.config());
    submit(&env, "panel-1").await;
    env.wait_for("panel-1", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(
        env.provider.peak_concurrency(),
        3,
        "the three calls were sent together"
    );
    engine.shutdown();

    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(200));
    let mut config = env.config();
    config.limits = Limits::parse(r#"{"*": {"concurrency": 1}}"#).unwrap();
    let _engine = env.start(registry(), config);
    submit(&env, "panel-2").await;
    env.wait_for("panel-2", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(
        env.provider.peak_concurrency(),
        1,
        "ONCEFLOW_LIMITS held within the job"
    );
    for step in ["panel-a", "panel-b", "panel-c", "judge"] {
        let key = format!("job:panel-2:{step}");
        assert_eq!(env.provider.requests_for(&key), 1, "{step}: one request");
        assert_eq!(env.provider.work_done(&key), 1, "{step}: paid once");
    }
}

/// A crash or a takeover at every boundary of every branch: the answered
/// calls replay from the journal, only the others are sent, and the judge
/// and the webhook happen once.
#[actix_rt::test]
async fn parallel_calls_survive_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let report = Explorer::new(&env, registry, Panel::NAME, json!({}))
        .run()
        .await;
    println!("{report}");
    // Four calls, each with its boundaries, in three modes.
    let sends = report
        .rows
        .iter()
        .filter(|r| r.boundary == onceflow_engine::FailPoint::ModelAfterSend)
        .count();
    assert_eq!(sends, 4 * 3, "{report}");
    report.assert_ok();
}

/// Three general steps at once (`ctx.step_all`), each posting its effect
/// with its own key. On a first attempt they also meet at a barrier: run
/// one by one, they would never all get there, and the job would die.
pub(crate) struct Notify {
    url: String,
    barrier: std::sync::Arc<tokio::sync::Barrier>,
}

impl Workflow for Notify {
    const NAME: &'static str = "test.notify_three";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let together = ctx.attempt() == 1;
        let steps: Vec<(&str, _)> = ["email", "sms", "slack"]
            .into_iter()
            .map(|channel| {
                let (url, barrier) = (self.url.clone(), self.barrier.clone());
                let work = move |step: onceflow_engine::StepInvocation| async move {
                    if together
                        && tokio::time::timeout(Duration::from_secs(5), barrier.wait())
                            .await
                            .is_err()
                    {
                        return Err(StepError::permanent(
                            "not_parallel",
                            "the steps did not run at once",
                            "the barrier timed out",
                        ));
                    }
                    step.post_json(&url, &json!({ "channel": channel, "job_id": step.job_id }))
                        .await
                };
                (channel, work)
            })
            .collect();
        let sent = ctx.step_all(steps).await?;
        Ok(json!({ "sent": sent.len() }))
    }
}

fn notify_registry(url: &str, barrier: &std::sync::Arc<tokio::sync::Barrier>) -> Registry {
    let mut r = Registry::new();
    r.register(Notify {
        url: url.to_owned(),
        barrier: barrier.clone(),
    });
    r
}

/// The three steps run at once (they meet at the barrier) and each effect
/// is sent once, under its own key.
#[actix_rt::test]
async fn parallel_steps_run_at_once_and_each_acts_once() {
    let env = TestEnv::new().await;
    let effects = onceflow_engine::testkit::FakeConsumer::start();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
    let _engine = env.start(notify_registry(&effects.url(), &barrier), env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "notify-1".into(),
        workflow: Notify::NAME.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let view = env
        .wait_for("notify-1", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(view.result.unwrap()["sent"], 3);
    for channel in ["email", "sms", "slack"] {
        let key = format!("job:notify-1:step:{channel}");
        assert_eq!(effects.requests_with_key(&key), 1, "{key}");
    }
    assert_eq!(effects.deliveries().len(), 3);
    assert_eq!(env.consumer.deliveries_for("notify-1").len(), 1);
}

/// A crash or a takeover at every boundary of every parallel step: the
/// journaled steps replay, only the others run again, and each effect is
/// processed once under its key.
#[actix_rt::test]
async fn parallel_steps_survive_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let effects = onceflow_engine::testkit::FakeConsumer::start();
    let url = effects.url();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
    let report = Explorer::new(
        &env,
        move || notify_registry(&url, &barrier),
        Notify::NAME,
        json!({}),
    )
    .recording(effects)
    .run()
    .await;
    println!("{report}");
    let effects = report
        .rows
        .iter()
        .filter(|r| r.boundary == onceflow_engine::FailPoint::StepAfterEffect)
        .count();
    assert_eq!(
        effects,
        3 * 3,
        "each step's effect, in three modes: {report}"
    );
    report.assert_ok();
}
