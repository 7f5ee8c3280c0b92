//! Durable waits: `ctx.sleep` and `ctx.wait_for_signal`. A waiting job
//! holds no actor and no lease; a signal is recorded once under its id and
//! taken by one wait; a restart during a wait changes nothing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::intake::NewJob;
use onceflow_engine::store::ListFilter;
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{Context, JobState, Registry, StepError, Workflow};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::support::{client, serve_api};

const WAIT: Duration = Duration::from_secs(20);

#[derive(Deserialize)]
struct PatientInput {
    sleep_ms: u64,
    timeout_ms: u64,
}

/// Naps, asks the model once, waits for `go` (with a timeout), then acts once.
struct Patient {
    acted: Arc<AtomicU32>,
}

impl Workflow for Patient {
    const NAME: &'static str = "test.patient";
    type Input = PatientInput;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, input: PatientInput) -> Result<Value, StepError> {
        ctx.sleep("nap", Duration::from_millis(input.sleep_ms))
            .await?;
        let question = json!({ "model": "m", "messages": [{ "role": "user", "content": "go?" }] });
        ctx.generate("ask", &question).await?;
        let go: Option<Value> = ctx
            .wait_for_signal("go", Duration::from_millis(input.timeout_ms))
            .await?;
        let acted = self.acted.clone();
        ctx.step("act", move |_| async move {
            Ok(acted.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await?;
        Ok(json!({ "go": go }))
    }
}

fn registry(acted: &Arc<AtomicU32>) -> Registry {
    let mut r = Registry::new();
    r.register(Patient {
        acted: acted.clone(),
    });
    r
}

async fn submit(env: &TestEnv, id: &str, sleep_ms: u64, timeout_ms: u64) {
    env.submit_job(NewJob {
        id: id.to_owned(),
        workflow: Patient::NAME.to_owned(),
        workflow_version: 1,
        input: json!({ "sleep_ms": sleep_ms, "timeout_ms": timeout_ms }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// Waits until job `id` waits for `kind`; panics with the job otherwise.
async fn wait_for_wait(env: &TestEnv, id: &str, kind: &str) -> Value {
    let found = wait_until(WAIT, || async {
        env.job(id).await.waiting.is_some_and(|w| w["kind"] == kind)
    })
    .await;
    let job = env.job(id).await;
    assert!(found, "job {id} never waited for a {kind}: {job:?}");
    job.waiting.unwrap()
}

async fn signal(base: &str, job: &str, name: &str, body: Value) -> (u16, Value) {
    let response = client()
        .post(format!("{base}/v1/jobs/{job}/signals/{name}"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .send()
        .await
        .expect("POST a signal");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[actix_rt::test]
async fn a_waiting_job_holds_no_lease_and_a_signal_is_recorded_once() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let engine = env.start(registry(&acted), env.config());
    let base = serve_api(env.store.clone(), registry(&acted), None);
    submit(&env, "w-1", 1_500, 60_000).await;

    // Asleep: no lease, no actor, listed as waiting.
    let waiting = wait_for_wait(&env, "w-1", "sleep").await;
    assert_eq!(waiting["name"], "nap");
    let leased = env
        .sql("SELECT lease_owner IS NOT NULL AS leased FROM jobs WHERE id = 'w-1'")
        .await;
    assert_eq!(leased[0]["leased"], false, "a sleeping job holds no lease");
    assert_eq!(engine.in_flight().await, 0, "a sleeping job holds no actor");
    let filter = ListFilter {
        waiting: Some(true),
        limit: 10,
        ..Default::default()
    };
    let (listed, _) = env.store.list_jobs(&filter).await.unwrap();
    assert_eq!(
        listed.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["w-1"]
    );

    // Awake, asked the model once, now waiting for `go`.
    let waiting = wait_for_wait(&env, "w-1", "signal").await;
    assert_eq!(waiting["name"], "go");
    assert_eq!(
        engine.in_flight().await,
        0,
        "a job waiting for a signal holds no actor"
    );
    assert_eq!(env.provider.requests_for("job:w-1:ask"), 1);

    // The signal: bad input first, then once, then again.
    let (status, body) = signal(&base, "w-1", "go", json!({ "id": "s 1", "payload": 1 })).await;
    assert_eq!((status, body["error"]["field"].as_str()), (422, Some("id")));
    let (status, body) = signal(&base, "w-1", "g/o", json!({ "id": "s-1", "payload": 1 })).await;
    assert_eq!(status, 404, "a name with a slash is another path: {body}");
    let (status, body) = signal(&base, "w-1", "go", json!({ "id": "s-1" })).await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("payload"))
    );
    let big = "x".repeat(65 * 1024);
    let (status, body) = signal(&base, "w-1", "go", json!({ "id": "s-1", "payload": big })).await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("payload"))
    );
    let (status, _) = signal(&base, "nobody", "go", json!({ "id": "s-1", "payload": 1 })).await;
    assert_eq!(status, 404);
    let payload = json!({ "approved": true, "by": "ada" });
    let (status, body) = signal(
        &base,
        "w-1",
        "go",
        json!({ "id": "s-1", "payload": payload }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["id"], "s-1");
    let (status, _) = signal(
        &base,
        "w-1",
        "go",
        json!({ "id": "s-1", "payload": payload }),
    )
    .await;
    assert_eq!(status, 200, "the identical signal again");
    let (status, body) = signal(
        &base,
        "w-1",
        "go",
        json!({ "id": "s-1", "payload": { "approved": false } }),
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("signal_conflict"))
    );

    let job = env.wait_for("w-1", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["go"], payload);
    assert_eq!(job.waiting, None);
    assert_eq!(job.signals.len(), 1, "{:?}", job.signals);
    assert_eq!(
        job.signals[0].taken_by.as_deref(),
        Some("job:w-1:signal:go")
    );
    assert_eq!(
        acted.load(Ordering::SeqCst),
        1,
        "the step after the wait ran once"
    );
    assert_eq!(
        env.provider.requests_for("job:w-1:ask"),
        1,
        "the model was asked once"
    );
    assert_eq!(env.consumer.processed_for("w-1"), 1);

    let (status, body) = signal(&base, "w-1", "go", json!({ "id": "s-2", "payload": 2 })).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("job_finished"))
    );
}

#[actix_rt::test]
async fn signals_sent_before_the_wait_are_kept_and_taken_oldest_first() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    submit(&env, "w-2", 0, 60_000).await;
    // Sent before any node runs the job: kept.
    for (id, payload) in [("first", json!("a")), ("second", json!("b"))] {
        let outcome = env.store.signal("w-2", "go", id, &payload).await.unwrap();
        assert!(
            matches!(
                outcome,
                onceflow_engine::store::waits::SignalOutcome::Created(_)
            ),
            "{outcome:?}"
        );
    }
    let _engine = env.start(registry(&acted), env.config());
    let job = env.wait_for("w-2", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["go"], "a", "the oldest signal is taken");
    let taken: Vec<Option<&str>> = job.signals.iter().map(|s| s.taken_by.as_deref()).collect();
    assert_eq!(
        taken,
        [Some("job:w-2:signal:go"), None],
        "one per wait; the other is kept"
    );
    assert_eq!(acted.load(Ordering::SeqCst), 1);
}

#[actix_rt::test]
async fn a_signal_wait_times_out_to_none() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let _engine = env.start(registry(&acted), env.config());
    submit(&env, "w-3", 0, 300).await;
    let job = env.wait_for("w-3", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["go"], Value::Null);
    let outcome = env
        .sql("SELECT outcome FROM waits WHERE job_id = 'w-3' AND wait_key = 'job:w-3:signal:go'")
        .await;
    assert_eq!(outcome[0]["outcome"], json!({ "timeout": true }));
}

#[actix_rt::test]
async fn a_node_stopped_during_a_wait_changes_nothing() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let first = env.start(registry(&acted), env.config());
    submit(&env, "w-4", 200, 60_000).await;
    wait_for_wait(&env, "w-4", "signal").await;
    first.shutdown_gracefully().await.unwrap();
    drop(first);

    // The signal arrives while no node runs; a new node finishes the job.
    env.store
        .signal("w-4", "go", "s-1", &json!(7))
        .await
        .unwrap();
    let _second = env.start(registry(&acted), env.config());
    let job = env.wait_for("w-4", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["go"], 7);
    assert_eq!(
        env.provider.requests_for("job:w-4:ask"),
        1,
        "the model call replayed"
    );
    assert_eq!(acted.load(Ordering::SeqCst), 1);
    // Both waits journaled once, with their outcomes; the nap was not taken again.
    let waits = env
        .sql("SELECT wait_key, outcome FROM waits WHERE job_id = 'w-4' ORDER BY created_at")
        .await;
    assert_eq!(
        waits,
        json!([
            { "wait_key": "job:w-4:sleep:nap", "outcome": { "slept": true } },
            { "wait_key": "job:w-4:signal:go", "outcome": { "signal": { "id": "s-1", "payload": 7 } } },
        ])
    );
    assert_eq!(env.consumer.processed_for("w-4"), 1);
}
