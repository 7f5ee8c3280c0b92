//! Parallel calls inside one job (`ctx.generate_all`): each call journaled
//! under its own key, sent at once, replayed after a crash, and admitted
//! one by one by the provider limits.

use std::time::Duration;

use onceflow_engine::intake::NewJob;
use onceflow_engine::quota::Limits;
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
