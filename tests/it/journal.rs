//! The journals' identities, checked with a workflow that changes what it
//! asks for between attempts: a key reused with another request is a loud
//! error even against a completed row, a ledger position reused by another
//! tool call is a conflict, and a replayed tool call returns the stored
//! result byte for byte. Also: idempotency is not determinism.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::TestEnv;
use onceflow_engine::{Context, ErrorEnvelope, JobState, Registry, StepError, Workflow};
use onceflow_workflows::Completion;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);

/// A workflow whose first attempt fails retryably after its side effect, so
/// the second attempt meets the journal.
#[derive(Clone)]
struct Changing {
    tool_runs: Arc<AtomicU32>,
}

#[derive(Deserialize)]
struct ChangingInput {
    /// `prompt`: another prompt under the same model key on attempt 2;
    /// `tool_id`: another tool-call id at the same position on attempt 2;
    /// `tool_replay`: the same tool call on both attempts.
    mode: String,
}

#[derive(Serialize)]
struct ChangingOutput {
    value: String,
}

fn retry_once(ctx: &Context) -> Result<(), StepError> {
    if ctx.attempt() == 1 {
        return Err(StepError::Retry {
            error: ErrorEnvelope {
                code: "test_retry".into(),
                message: "the first attempt fails after its side effect".into(),
                retryable: true,
            },
            attempt: 1,
            retry_after: None,
        });
    }
    Ok(())
}

impl Workflow for Changing {
    const NAME: &'static str = "test.changing";
    type Input = ChangingInput;
    type Output = ChangingOutput;

    async fn run(
        &self,
        ctx: &mut Context,
        input: ChangingInput,
    ) -> Result<ChangingOutput, StepError> {
        let value = match input.mode.as_str() {
            "prompt" => {
                let request = json!({"model": "m", "messages": [
                    {"role": "user", "content": format!("attempt {}", ctx.attempt())}]});
                let answer = ctx.generate("generate", &request).await?;
                answer["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            }
            "tool_id" | "tool_replay" => {
                let call_id = if input.mode == "tool_id" {
                    format!("call-{}", ctx.attempt())
                } else {
                    "call-1".to_owned()
                };
                let runs = self.tool_runs.clone();
                ctx.tool(0, 0, &call_id, "lookup", &json!({"q": 1}), |_| async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    Ok(format!("résultat  \u{2014} run #{n}\n{{\"a\": 1}}  "))
                })
                .await?
            }
            other => panic!("unknown mode {other}"),
        };
        retry_once(ctx)?;
        Ok(ChangingOutput { value })
    }
}

fn setup() -> (Registry, Arc<AtomicU32>) {
    let tool_runs = Arc::new(AtomicU32::new(0));
    let mut r = Registry::new();
    r.register(Completion::default());
    r.register(Changing {
        tool_runs: tool_runs.clone(),
    });
    (r, tool_runs)
}

async fn submit(env: &TestEnv, id: &str, mode: &str) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: "test.changing".into(),
        workflow_version: 1,
        input: json!({ "mode": mode }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

#[actix_rt::test]
async fn a_model_key_reused_with_another_request_fails_even_after_it_completed() {
    let env = TestEnv::new().await;
    let (registry, _) = setup();
    let _engine = env.start(registry, env.config());
    submit(&env, "reuse-1", "prompt").await;
    let job = env.wait_for("reuse-1", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.as_ref().unwrap().code, "model_key_conflict");
    assert_eq!(
        env.provider.requests_for("job:reuse-1:generate"),
        1,
        "the second prompt was never sent"
    );
    assert_eq!(env.consumer.deliveries_for("reuse-1").len(), 0);
    assert!(job.attempts >= 2);
}

#[actix_rt::test]
async fn the_same_tool_position_with_another_call_id_is_a_conflict() {
    let env = TestEnv::new().await;
    let (registry, tool_runs) = setup();
    let _engine = env.start(registry, env.config());
    submit(&env, "tool-id-1", "tool_id").await;
    let job = env.wait_for("tool-id-1", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.as_ref().unwrap().code, "tool_call_conflict");
    assert_eq!(tool_runs.load(Ordering::SeqCst), 1, "executed once");
    assert_eq!(env.consumer.deliveries_for("tool-id-1").len(), 0);
}

#[actix_rt::test]
async fn a_replayed_tool_call_returns_the_stored_result_byte_for_byte() {
    let env = TestEnv::new().await;
    let (registry, tool_runs) = setup();
    let _engine = env.start(registry, env.config());
    submit(&env, "replay-1", "tool_replay").await;
    let job = env.wait_for("replay-1", JobState::Acked, WAIT).await;
    assert!(job.attempts >= 2, "the replay happened on a later attempt");
    assert_eq!(tool_runs.load(Ordering::SeqCst), 1, "executed once");
    // Non-ASCII, inner and trailing whitespace, a newline, JSON-looking
    // text: returned exactly as the tool produced it.
    let first = "résultat  \u{2014} run #1\n{\"a\": 1}  ";
    assert_eq!(job.result.unwrap()["value"], first);
    let stored = env
        .sql("SELECT result FROM tool_calls WHERE job_id = 'replay-1'")
        .await;
    assert_eq!(stored[0]["result"], first);
}

/// Two jobs with one prompt get different answers (the provider does the
/// work twice); only a retry of the same job replays.
#[actix_rt::test]
async fn idempotency_is_not_determinism() {
    let env = TestEnv::new().await;
    let (registry, _) = setup();
    let _engine = env.start(registry, env.config());
    env.submit("same-a", "one prompt").await;
    env.submit("same-b", "one prompt").await;
    let a = env.wait_for("same-a", JobState::Acked, WAIT).await;
    let b = env.wait_for("same-b", JobState::Acked, WAIT).await;
    let content = |v: &Option<Value>| v.as_ref().unwrap()["content"].clone();
    assert_ne!(content(&a.result), content(&b.result));
    assert_eq!(env.provider.work_done("job:same-a:generate"), 1);
    assert_eq!(env.provider.work_done("job:same-b:generate"), 1);
    assert_eq!(env.provider.total_work(), 2);
}

/// An id submitted again after its job was purged is a new incarnation: the
/// first keeps `job:{id}:completed`, the second is keyed `job:{id}#2:…`, so a
/// consumer that de-duplicates by webhook-id processes it, and lease epochs
/// continue from the first (a zombie of the old life cannot match).
#[actix_rt::test]
async fn a_purged_id_runs_again_as_a_new_incarnation_with_its_own_keys() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.retention = Duration::from_secs(3600);
    let (registry, _) = setup();
    let engine = env.start(registry, config);
    env.submit("again-1", "first life").await;
    env.wait_for("again-1", JobState::Acked, WAIT).await;
    let first_epoch = env
        .sql("SELECT lease_epoch FROM jobs WHERE id = 'again-1'")
        .await[0]["lease_epoch"]
        .as_i64()
        .unwrap();
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id = 'again-1'")
        .await;
    // Behind the node's back: its purge is armed for an hour from the
    // finish it saw, so it is told to purge now.
    engine.purge_now();
    let purged = onceflow_engine::testkit::wait_until(WAIT, || async {
        env.store.jobs().get("again-1").await.unwrap().is_none()
    })
    .await;
    assert!(purged, "the supervisor purged the expired job");
    let tomb = env
        .sql("SELECT incarnation, last_epoch FROM job_tombstones WHERE id = 'again-1'")
        .await;
    assert_eq!(tomb[0]["incarnation"], 1);
    assert_eq!(tomb[0]["last_epoch"], first_epoch);

    let second = env.submit("again-1", "second life").await;
    assert_eq!(second.incarnation, 2);
    let job = env.wait_for("again-1", JobState::Acked, WAIT).await;
    assert_eq!(job.incarnation, 2);
    assert_eq!(
        job.delivery.unwrap().idempotency_key,
        "job:again-1#2:completed"
    );
    let epoch = env
        .sql("SELECT lease_epoch FROM jobs WHERE id = 'again-1'")
        .await[0]["lease_epoch"]
        .as_i64()
        .unwrap();
    assert!(
        epoch > first_epoch,
        "epochs continue: {epoch} after {first_epoch}"
    );
    let ids: Vec<Option<String>> = env
        .consumer
        .deliveries_for("again-1")
        .into_iter()
        .map(|d| d.webhook_id)
        .collect();
    assert_eq!(
        ids,
        [
            Some("job:again-1:completed".to_owned()),
            Some("job:again-1#2:completed".to_owned())
        ]
    );
    assert_eq!(
        env.consumer.processed_for("again-1"),
        2,
        "not dropped as a repeat"
    );
    assert_eq!(env.provider.requests_for("job:again-1:generate"), 1);
    assert_eq!(env.provider.requests_for("job:again-1#2:generate"), 1);
}

/// A workflow that naps (a durable timer: one more job attempt), then posts
/// to the consumer in a general step, under the step's key.
#[derive(Clone)]
struct Posting {
    url: String,
}

impl Workflow for Posting {
    const NAME: &'static str = "test.posting";
    type Input = Value;
    type Output = String;

    async fn run(&self, ctx: &mut Context, _input: Value) -> Result<String, StepError> {
        // Long enough to be a wait of its own (one more lease), not over
        // before its own statement returns.
        ctx.sleep("nap", Duration::from_millis(150)).await?;
        let url = self.url.clone();
        let job = ctx.job_id().to_owned();
        ctx.step("post", |step| async move {
            step.post_json(&url, &json!({ "job_id": job })).await
        })
        .await
    }
}

/// A general step's retry budget is its own: a step that keeps failing
/// (the consumer answers 503) is sent exactly the budget's 6 times, under
/// the step's key, whatever the job's attempts (its nap took one more), and
/// the job is dead saying so. A redrive gives the step a fresh budget under
/// the same key: refused once more, it is retried, and the job is acked.
#[actix_rt::test]
async fn a_step_that_keeps_failing_is_dead_after_its_own_budget() {
    use onceflow_engine::testkit::Behaviour;
    let env = TestEnv::new().await;
    for _ in 0..6 {
        env.consumer.push_for("flaky", Behaviour::Status(503, None));
    }
    let mut registry = Registry::new();
    registry.register(Posting {
        url: env.consumer.url(),
    });
    let _engine = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "flaky".into(),
        workflow: "test.posting".into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("flaky", JobState::Dead, WAIT).await;
    let key = "job:flaky:step:post";
    assert_eq!(
        env.consumer.requests_with_key(key),
        6,
        "the budget's 6 sends"
    );
    assert_eq!(
        job.dead_reason.as_deref(),
        Some("retry budget exhausted after 6 sends")
    );
    assert!(
        job.attempts > 6,
        "the nap took an attempt of its own: {}",
        job.attempts
    );
    assert_eq!(
        env.sql("SELECT failures FROM step_failures WHERE job_id = 'flaky'")
            .await[0]["failures"],
        json!(6)
    );
    // Once more refused after the redrive: a spent budget would end it dead.
    env.consumer.push_for("flaky", Behaviour::Status(503, None));
    env.store
        .jobs()
        .redrive("flaky", "test", "the consumer is back", false)
        .await
        .unwrap();
    env.wait_for("flaky", JobState::Acked, WAIT).await;
    assert_eq!(env.consumer.requests_with_key(key), 8, "two more sends");
    assert_eq!(env.consumer.processed_with_key(key), 1, "done once");
}

/// A workflow that naps 7 times (each nap a lease of its own), then fails
/// retryably in its body with `ctx.retry`, counting how often it got there.
#[derive(Clone)]
struct Missing {
    failed: Arc<AtomicU32>,
}

impl Workflow for Missing {
    const NAME: &'static str = "test.missing";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _input: Value) -> Result<Value, StepError> {
        for i in 0..7 {
            ctx.sleep(&format!("nap-{i}"), Duration::from_millis(100))
                .await?;
        }
        self.failed.fetch_add(1, Ordering::SeqCst);
        let error = ErrorEnvelope {
            code: "tool_unavailable".into(),
            message: "not on this node".into(),
            retryable: true,
        };
        Err(ctx.retry("missing", error).await)
    }
}

/// `ctx.retry` budgets a body's own retryable failure by its name: a job
/// whose 7 naps took 8 leases (past the test budget of 6 by
/// `ctx.attempt()`) still fails exactly 6 times before it is dead.
#[actix_rt::test]
async fn a_body_retry_has_a_budget_of_its_own_whatever_the_jobs_attempts() {
    let env = TestEnv::new().await;
    let failed = Arc::new(AtomicU32::new(0));
    let mut registry = Registry::new();
    registry.register(Missing {
        failed: failed.clone(),
    });
    let _engine = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "missing".into(),
        workflow: "test.missing".into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("missing", JobState::Dead, WAIT).await;
    assert_eq!(failed.load(Ordering::SeqCst), 6, "the name's 6 failures");
    assert_eq!(
        job.dead_reason.as_deref(),
        Some("retry budget exhausted after 6 sends")
    );
    assert!(
        job.attempts >= 8 + 5,
        "8 leases to get there, then 5 retries: {}",
        job.attempts
    );
    assert_eq!(
        env.sql("SELECT step_key, failures FROM step_failures WHERE job_id = 'missing'")
            .await,
        json!([{ "step_key": "job:missing:retry:missing", "failures": 6 }])
    );
}
