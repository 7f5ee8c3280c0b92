//! Durable waits: `ctx.sleep` and `ctx.wait_for_signal`. A waiting job
//! holds no actor and no lease; a signal is recorded once under its id and
//! taken by one wait; a restart during a wait changes nothing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::node::intake::NewJob;
use onceflow_engine::store::{Held, ListFilter};
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{Context, EngineConfig, JobState, Registry, StepError, Workflow};
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
        tags: Default::default(),
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
    let base = serve_api(&env, registry(&acted), None);
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
        waiting_kind: Some("sleep".to_owned()),
        limit: 10,
        ..Default::default()
    };
    let (listed, _) = env.store.jobs().list(&filter).await.unwrap();
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
        let outcome = env
            .store
            .waits()
            .signal(
                "w-2",
                "go",
                &onceflow_engine::rules::signal::SignalBody::new(id, payload.clone()),
            )
            .await
            .unwrap();
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
        .waits()
        .signal(
            "w-4",
            "go",
            &onceflow_engine::rules::signal::SignalBody::new("s-1", json!(7)),
        )
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

/// A timer interrupted by a restart keeps its due time: the node that
/// resumes the job does not start the sleep over.
#[actix_rt::test]
async fn a_timer_keeps_its_due_time_across_a_restart() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let first = env.start(registry(&acted), env.config());
    submit(&env, "w-9", 2_000, 100).await;
    wait_for_wait(&env, "w-9", "sleep").await;
    let due = "SELECT until::text AS until FROM waits WHERE job_id = 'w-9' AND kind = 'sleep'";
    let before = env.sql(due).await;
    first.shutdown_gracefully().await.unwrap();
    drop(first);
    let pending = env
        .sql("SELECT done_at IS NULL AS pending FROM waits WHERE job_id = 'w-9' AND kind = 'sleep'")
        .await;
    assert_eq!(
        pending[0]["pending"], true,
        "stopped with time left on the timer"
    );
    let _second = env.start(registry(&acted), env.config());
    env.wait_for("w-9", JobState::Acked, WAIT).await;
    let fired = env
        .sql(
            "SELECT done_at >= until AS on_time FROM waits WHERE job_id = 'w-9' AND kind = 'sleep'",
        )
        .await;
    assert_eq!(fired[0]["on_time"], true, "never before its due time");
    assert_eq!(
        env.sql(due).await,
        before,
        "the same timer, due when it was"
    );
    let waits = env
        .sql("SELECT wait_key, outcome FROM waits WHERE job_id = 'w-9' ORDER BY created_at")
        .await;
    assert_eq!(
        waits,
        json!([
            { "wait_key": "job:w-9:sleep:nap", "outcome": { "slept": true } },
            { "wait_key": "job:w-9:signal:go", "outcome": { "timeout": true } },
        ])
    );
    assert_eq!(acted.load(Ordering::SeqCst), 1);
}

#[derive(Deserialize)]
struct AlarmInput {
    at: chrono::DateTime<chrono::Utc>,
}

/// Sleeps until the instant its input names.
struct Alarm;

impl Workflow for Alarm {
    const NAME: &'static str = "test.alarm";
    type Input = AlarmInput;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, input: AlarmInput) -> Result<Value, StepError> {
        ctx.sleep_until("alarm", input.at).await?;
        Ok(json!({ "rang": true }))
    }
}

/// `ctx.sleep_until` journals the instant it was given as its due time
/// (not one computed from when the body reached it) and fires at or
/// after it.
#[actix_rt::test]
async fn sleep_until_waits_for_the_instant_it_names() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(Alarm);
    let _engine = env.start(registry, env.config());
    let at = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    let at = at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "alarm-1".to_owned(),
        workflow: Alarm::NAME.to_owned(),
        workflow_version: 1,
        input: json!({ "at": at }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let waiting = wait_for_wait(&env, "alarm-1", "sleep").await;
    assert_eq!(waiting["name"], "alarm");
    env.wait_for("alarm-1", JobState::Acked, WAIT).await;
    let rows = env
        .sql(&format!(
            "SELECT wait_key, until = '{at}'::timestamptz AS as_given, done_at >= until AS on_time \
             FROM waits WHERE job_id = 'alarm-1'"
        ))
        .await;
    assert_eq!(
        rows,
        json!([{ "wait_key": "job:alarm-1:sleep:alarm", "as_given": true, "on_time": true }])
    );
}

/// A node polls at the due time of each wait it released, not only at its
/// poll ticks: with a poll interval of a minute, a job that naps 300 ms and
/// then waits 300 ms for a signal nobody sends ends within seconds.
#[actix_rt::test]
async fn a_node_fires_the_timers_it_released_at_their_time_not_at_its_next_poll() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let config = EngineConfig {
        poll_interval: Duration::from_secs(60),
        ..env.config()
    };
    let _engine = env.start(registry(&acted), config);
    submit(&env, "w-6", 300, 300).await;
    let job = env.wait_for("w-6", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["go"], Value::Null);
    assert_eq!(acted.load(Ordering::SeqCst), 1);
    // Each fired well before the node's next poll tick (a minute away).
    let waits = env
        .sql(
            "SELECT wait_key, outcome, done_at - until < interval '10 seconds' AS before_a_tick \
             FROM waits WHERE job_id = 'w-6' ORDER BY created_at",
        )
        .await;
    assert_eq!(
        waits,
        json!([
            { "wait_key": "job:w-6:sleep:nap", "outcome": { "slept": true }, "before_a_tick": true },
            { "wait_key": "job:w-6:signal:go", "outcome": { "timeout": true }, "before_a_tick": true },
        ])
    );
    assert_eq!(env.consumer.processed_for("w-6"), 1);
}

/// A signal wakes its job through `NOTIFY`, not the poll: with a poll
/// interval of a minute and the wait's own timeout two minutes away, a
/// signal sent over the API resumes the job within seconds. While it
/// waits, the job is `received` and `GET /v1/jobs?waiting=true` lists it.
#[actix_rt::test]
async fn a_signal_wakes_its_job_by_notify_not_by_the_poll() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let config = EngineConfig {
        poll_interval: Duration::from_secs(60),
        ..env.config()
    };
    let _engine = env.start(registry(&acted), config);
    let base = serve_api(&env, registry(&acted), None);
    submit(&env, "w-7", 0, 120_000).await;
    submit(&env, "w-8", 3_600_000, 0).await;
    wait_for_wait(&env, "w-7", "signal").await;
    wait_for_wait(&env, "w-8", "sleep").await;
    for id in ["w-7", "w-8"] {
        assert_eq!(
            env.job(id).await.state,
            JobState::Received,
            "{id} waits in received"
        );
    }
    let list = |query: &'static str| {
        let base = base.clone();
        async move {
            let page: Value = client()
                .get(format!("{base}/v1/jobs?{query}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let mut ids: Vec<String> = page["jobs"]
                .as_array()
                .unwrap_or_else(|| panic!("no jobs in {page}"))
                .iter()
                .map(|j| j["id"].as_str().unwrap().to_owned())
                .collect();
            ids.sort();
            ids
        }
    };
    assert_eq!(list("waiting=true").await, ["w-7", "w-8"]);
    assert_eq!(list("waiting=signal").await, ["w-7"]);
    assert_eq!(list("waiting=sleep").await, ["w-8"]);
    assert!(list("waiting=approval").await.is_empty());
    let response = client()
        .get(format!("{base}/v1/jobs?waiting=maybe"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);

    // A signal sent "for" a timer (the sleeper's name and due time) is no
    // decision of a wait: refused, nothing recorded.
    let nap = env.job("w-8").await.waiting.unwrap()["until"].clone();
    let body = json!({ "id": "s-0", "payload": 0, "until": nap });
    let (status, answer) = signal(&base, "w-8", "nap", body).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("not_waiting")),
        "{answer}"
    );
    assert!(env.job("w-8").await.signals.is_empty());
    let sent = std::time::Instant::now();
    let (status, _) = signal(&base, "w-7", "go", json!({ "id": "s-1", "payload": 1 })).await;
    assert_eq!(status, 202);
    let job = env.wait_for("w-7", JobState::Acked, WAIT).await;
    eprintln!(
        "the signalled job acked {:?} after the signal",
        sent.elapsed()
    );
    assert_eq!(job.result.unwrap()["go"], 1);
    assert_eq!(
        list("waiting=true").await,
        ["w-8"],
        "the sleeper still waits"
    );
    assert_eq!(acted.load(Ordering::SeqCst), 1);
}

/// Jobs that wake together read their journals together: twelve jobs
/// whose naps end at once queue their reads behind a held batch, which then
/// runs as one statement, and each job gets its own journal. A job handed
/// another's journal would fail as `journal_mismatch`, not ack; one handed
/// none would still be kept from paying twice by its keys, so the model
/// calls are counted too.
#[actix_rt::test]
async fn jobs_that_wake_together_read_their_own_journals_in_one_batch() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let _engine = env.start(registry(&acted), env.config());
    env.store.group_commit().seam(Held::JournalReads).hold(true);
    let ids: Vec<String> = (0..12).map(|i| format!("wj-{i:02}")).collect();
    for id in &ids {
        submit(&env, id, 500, 200).await;
    }
    let queued = wait_until(WAIT, || async {
        env.store.group_commit().seam(Held::JournalReads).queued() == 12
    })
    .await;
    assert!(
        queued,
        "the reruns' journal reads queue behind the held batch: {}",
        env.store.group_commit().seam(Held::JournalReads).queued()
    );
    env.store
        .group_commit()
        .seam(Held::JournalReads)
        .hold(false);
    for id in &ids {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert_eq!(job.result.unwrap()["go"], Value::Null, "{id}");
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:ask")),
            1,
            "{id} paid once"
        );
        assert_eq!(env.consumer.processed_for(id), 1, "{id}");
    }
    assert!(
        env.store.group_commit().seam(Held::JournalReads).largest() >= 12,
        "the twelve reads ran as one statement: largest batch {}",
        env.store.group_commit().seam(Held::JournalReads).largest()
    );
    assert_eq!(acted.load(Ordering::SeqCst), 12);
}

/// The batched journal read gives each job exactly the journal the
/// single-job query gives it: every kind of key (model calls, tool calls
/// under the job's prefix, steps, waits with their outcomes), in order,
/// for three jobs read in one batch.
#[actix_rt::test]
async fn a_batched_journal_read_is_each_jobs_own_journal_in_order() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "refund": 7 }))]);
    let acted = Arc::new(AtomicU32::new(0));
    let mut registry = registry(&acted);
    registry.register(
        onceflow_workflows::Agent::new().with_tool(onceflow_workflows::HttpPost::new(tools.url())),
    );
    let _engine = env.start(registry, env.config());
    submit(&env, "jb-p1", 0, 0).await;
    submit(&env, "jb-p2", 0, 0).await;
    submit_agent(&env, "jb-a1", json!([])).await;
    for id in ["jb-p1", "jb-p2", "jb-a1"] {
        env.wait_for(id, JobState::Acked, WAIT).await;
    }

    env.store.group_commit().seam(Held::JournalReads).hold(true);
    let reads = ["jb-p1", "jb-a1", "jb-p2"].map(|id| {
        let store = env.store.clone();
        let fence = onceflow_engine::store::Fence {
            job_id: id.to_owned(),
            incarnation: 1,
            epoch: 0,
            attempt: 9,
            worker: "reader".to_owned(),
        };
        tokio::spawn(async move { store.journal().keys(&fence).await.unwrap() })
    });
    let queued = wait_until(WAIT, || async {
        env.store.group_commit().seam(Held::JournalReads).queued() == 3
    })
    .await;
    assert!(queued, "the three reads queue behind the held batch");
    env.store
        .group_commit()
        .seam(Held::JournalReads)
        .hold(false);
    let mut batched = Vec::new();
    for read in reads {
        batched.push(read.await.unwrap());
    }
    assert!(
        env.store.group_commit().seam(Held::JournalReads).largest() >= 3,
        "one batch of three"
    );

    for (id, got) in ["jb-p1", "jb-a1", "jb-p2"].into_iter().zip(batched) {
        let got: Vec<Value> = got
            .into_iter()
            .map(|k| json!({ "key": k.key, "outcome": k.outcome }))
            .collect();
        let want = env
            .sql(&format!(
                "SELECT key, outcome FROM ( \
                     SELECT idempotency_key AS key, created_at, id AS seq, NULL::jsonb AS outcome \
                         FROM model_calls WHERE job_id = '{id}' \
                     UNION ALL SELECT 'job:{id}:tool:' || turn || ':' || call_index, created_at, id, NULL \
                         FROM tool_calls WHERE job_id = '{id}' \
                     UNION ALL SELECT step_key, created_at, 0, NULL FROM steps WHERE job_id = '{id}' \
                     UNION ALL SELECT wait_key, created_at, 0, outcome FROM waits WHERE job_id = '{id}') k \
                 ORDER BY created_at, seq"
            ))
            .await;
        assert_eq!(Value::Array(got), want, "{id}");
    }
    // The journals hold what the bodies did, every kind of key included.
    let keys = |v: Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["key"].as_str().unwrap().to_owned())
            .collect()
    };
    let p1 = keys(
        env.sql("SELECT wait_key AS key FROM waits WHERE job_id = 'jb-p1' ORDER BY created_at")
            .await,
    );
    assert_eq!(p1, ["job:jb-p1:sleep:nap", "job:jb-p1:signal:go"]);
    let tool = env
        .sql("SELECT count(*)::int AS n FROM tool_calls WHERE job_id = 'jb-a1'")
        .await;
    assert_eq!(tool[0]["n"], 1, "the agent's tool call is journaled");
}

// ---- human approval of the agent's tool calls ----------------------------

fn agent_registry(tool_url: &str) -> Registry {
    let mut r = Registry::new();
    r.register(
        onceflow_workflows::Agent::new().with_tool(onceflow_workflows::HttpPost::new(tool_url)),
    );
    r
}

async fn submit_agent(env: &TestEnv, id: &str, approval: Value) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: "agent".to_owned(),
        workflow_version: 1,
        input: json!({
            "model": "m",
            "messages": [{ "role": "user", "content": "refund order 7" }],
            "approval": approval,
            "approval_timeout_s": 2,
        }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

#[actix_rt::test]
async fn an_approved_tool_call_runs_once_after_its_approval() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "refund": 7 }))]);
    let engine = env.start(agent_registry(&tools.url()), env.config());
    let base = serve_api(&env, agent_registry(&tools.url()), None);
    submit_agent(&env, "ap-1", json!(["http_post"])).await;

    let waiting = wait_for_wait(&env, "ap-1", "approval").await;
    assert_eq!(waiting["name"], "approval:call_1");
    assert_eq!(waiting["tool"]["name"], "http_post");
    assert_eq!(waiting["tool"]["arguments"], json!({ "refund": 7 }));
    assert_eq!(engine.in_flight().await, 0);
    assert_eq!(
        tools.requests_with_key("job:ap-1:tool:0:0"),
        0,
        "nothing ran before the approval"
    );
    // The job.waiting event, once.
    let event_key = "job:ap-1:waiting:approval:call_1";
    assert!(
        wait_until(WAIT, || async {
            env.consumer.requests_with_key(event_key) >= 1
        })
        .await,
        "no job.waiting event"
    );
    let event = env
        .consumer
        .deliveries_for("ap-1")
        .into_iter()
        .find(|d| d.idempotency_key.as_deref() == Some(event_key))
        .expect("the job.waiting delivery");
    assert_eq!(event.body["type"], "job.waiting");
    let waiting = &event.body["data"]["waiting"];
    assert_eq!(
        (waiting["kind"].as_str(), waiting["name"].as_str()),
        (Some("approval"), Some("approval:call_1")),
        "{}",
        event.body
    );
    assert_eq!(waiting["tool"]["name"], "http_post", "{}", event.body);
    assert_eq!(
        waiting["tool"]["arguments"],
        json!({ "refund": 7 }),
        "{}",
        event.body
    );

    let (status, body) = signal(
        &base,
        "ap-1",
        "approval:call_1",
        json!({ "id": "d-1", "payload": { "ok": 1 } }),
    )
    .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("payload"))
    );
    let decision = json!({ "id": "d-1", "payload": { "approved": true, "note": "fine" } });
    let (status, _) = signal(&base, "ap-1", "approval:call_1", decision).await;
    assert_eq!(status, 202);
    let job = env.wait_for("ap-1", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["tool_calls"], 1);
    assert_eq!(
        tools.requests_with_key("job:ap-1:tool:0:0"),
        1,
        "the approved tool ran once"
    );
    assert_eq!(
        env.consumer.requests_with_key(event_key),
        1,
        "one job.waiting per wait"
    );
    assert_eq!(
        env.consumer.processed_for("ap-1"),
        2,
        "job.waiting, then job.completed"
    );
}

#[actix_rt::test]
async fn a_refused_or_unanswered_tool_call_never_runs() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "refund": 7 }))]);
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    submit_agent(&env, "ap-2", json!("all")).await;
    wait_for_wait(&env, "ap-2", "approval").await;
    let refusal = json!({ "approved": false, "note": "not this customer" });
    env.store
        .waits()
        .signal(
            "ap-2",
            "approval:call_1",
            &onceflow_engine::rules::signal::SignalBody::new("d-1", refusal.clone()),
        )
        .await
        .unwrap();
    let job = env.wait_for("ap-2", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["tool_calls"], 0);

    // No answer within approval_timeout_s (2 s): refused too.
    submit_agent(&env, "ap-3", json!("all")).await;
    let job = env.wait_for("ap-3", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["tool_calls"], 0);

    assert_eq!(tools.requests_with_key("job:ap-2:tool:0:0"), 0);
    assert_eq!(tools.requests_with_key("job:ap-3:tool:0:0"), 0);
    let told = crate::agent::tool_messages(&env);
    assert!(
        told.iter()
            .any(|m| m.contains("refused") && m.contains("not this customer")),
        "{told:?}"
    );
    assert!(
        told.iter().any(|m| m.contains("not approved within 2 s")),
        "{told:?}"
    );
}

/// Asks twice for the approval of one tool call id (a provider that reuses
/// its ids across turns does this).
struct AsksTwice;

impl Workflow for AsksTwice {
    const NAME: &'static str = "test.asks_twice";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let mut answers = Vec::new();
        for _ in 0..2 {
            let decision = ctx
                .wait_for_approval("c-1", "refund", &json!({ "order": 7 }), WAIT * 3)
                .await?;
            answers.push(decision.map(|d| d.approved));
        }
        Ok(json!(answers))
    }
}

/// Each approval wait sends its own `job.waiting` event once: the second
/// wait for the same name is keyed `…#2`, like its wait.
#[actix_rt::test]
async fn each_approval_wait_of_one_name_sends_its_own_event_once() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(AsksTwice);
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut config = env.config();
    config.webhook_secret = Some(secret.parse().unwrap());
    let _engine = env.start(registry, config);
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "twice".to_owned(),
        workflow: AsksTwice::NAME.to_owned(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let mut api = Registry::new();
    api.register(AsksTwice);
    let base = serve_api(&env, api, None);
    let keys = [
        "job:twice:waiting:approval:c-1",
        "job:twice:waiting:approval:c-1#2",
    ];
    let mut decided: Vec<Value> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        assert!(
            wait_until(WAIT, || async { env.consumer.requests_with_key(key) >= 1 }).await,
            "no job.waiting event under {key}: {}",
            env.sql("SELECT event, idempotency_key, status FROM outbox")
                .await,
        );
        // The wait the event announced (set in the same commit).
        let until = env.job("twice").await.waiting.expect("waiting")["until"].clone();
        if let Some(stale) = decided.last() {
            // A decision for the first wait, sent again under a new id once
            // that wait is over (a page left open): refused, not kept for
            // the second wait of the same name.
            let body = json!({ "id": "late", "payload": { "approved": true }, "until": stale });
            let (status, answer) = signal(&base, "twice", "approval:c-1", body).await;
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (409, Some("not_waiting")),
                "{answer}"
            );
        }
        let bad = json!({ "id": "bad", "payload": { "approved": true }, "until": "soon" });
        let (status, answer) = signal(&base, "twice", "approval:c-1", bad).await;
        assert_eq!(
            (status, answer["error"]["field"].as_str()),
            (422, Some("until"))
        );
        let decision =
            json!({ "id": format!("d-{i}"), "payload": { "approved": i == 0 }, "until": until });
        let (status, answer) = signal(&base, "twice", "approval:c-1", decision).await;
        assert_eq!(status, 202, "{answer}");
        decided.push(until);
    }
    let job = env.wait_for("twice", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap(), json!([true, false]));
    let ids: Vec<&str> = job.signals.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["d-0", "d-1"], "nothing else recorded");
    for key in keys {
        assert_eq!(env.consumer.requests_with_key(key), 1, "{key}");
    }
    // Signed like every other event (Standard Webhooks, the node's secret).
    let secret: onceflow_engine::net::webhook::WebhookSecret = secret.parse().unwrap();
    let events: Vec<_> = env
        .consumer
        .deliveries_for("twice")
        .into_iter()
        .filter(|d| d.body["type"] == "job.waiting")
        .collect();
    assert_eq!(events.len(), 2);
    for d in events {
        let id = d.webhook_id.as_deref().unwrap();
        let ts: i64 = d.timestamp.as_deref().unwrap().parse().unwrap();
        assert_eq!(
            d.signature.as_deref(),
            Some(secret.sign(id, ts, &d.raw).as_str()),
            "{id}"
        );
    }
}

/// Untaken signals per job are bounded, in count and in bytes: past
/// either, a signal is refused `409 too_many_signals` and nothing is
/// recorded.
#[actix_rt::test]
async fn untaken_signals_per_job_are_bounded() {
    let env = TestEnv::new().await;
    let acted = Arc::new(AtomicU32::new(0));
    let base = serve_api(&env, registry(&acted), None);
    // No node runs: the jobs wait at `received`, and take no signal.
    submit(&env, "many", 0, 1_000).await;
    submit(&env, "large", 0, 1_000).await;
    for i in 0..100 {
        let (status, answer) = signal(
            &base,
            "many",
            "note",
            json!({ "id": format!("n-{i}"), "payload": i }),
        )
        .await;
        assert_eq!(status, 202, "{i}: {answer}");
    }
    let (status, answer) = signal(
        &base,
        "many",
        "note",
        json!({ "id": "n-100", "payload": 100 }),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("too_many_signals")),
        "{answer}"
    );
    let big = "x".repeat(64_000);
    let mut accepted = 0;
    loop {
        let (status, answer) = signal(
            &base,
            "large",
            "note",
            json!({ "id": format!("l-{accepted}"), "payload": big }),
        )
        .await;
        if status != 202 {
            assert_eq!(answer["error"]["code"], "too_many_signals", "{answer}");
            break;
        }
        accepted += 1;
        assert!(accepted < 100, "no byte bound");
    }
    // 1 MiB of them: 16 payloads of 64,002 bytes fit in it, not 17.
    assert_eq!(accepted, 16);
    for (job, n) in [("many", 100), ("large", 16)] {
        assert_eq!(
            env.sql(&format!(
                "SELECT count(*) AS n FROM signals WHERE job_id = '{job}'"
            ))
            .await[0]["n"],
            n
        );
    }
}

/// Waits for `go` twice: the second wait is short.
struct GoTwice;

impl Workflow for GoTwice {
    const NAME: &'static str = "test.go_twice";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let first: Option<Value> = ctx.wait_for_signal("go", WAIT * 3).await?;
        let second: Option<Value> = ctx
            .wait_for_signal("go", Duration::from_millis(1500))
            .await?;
        Ok(json!([first, second]))
    }
}

fn go_twice() -> Registry {
    let mut registry = Registry::new();
    registry.register(GoTwice);
    registry
}

async fn submit_go_twice(env: &TestEnv, id: &str) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: GoTwice::NAME.to_owned(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// Two decisions sent at once for one wait (its `until`), under different
/// ids (two operators, a client retrying with a fresh id): one is recorded,
/// the other is refused `409` (`wait_decided`, or `not_waiting` once the
/// wait took the first and is over), and the later wait of the same
/// name never takes a decision meant for the first: it times out.
#[actix_rt::test]
async fn a_decision_for_one_wait_is_never_taken_by_a_later_wait() {
    let env = TestEnv::new().await;
    let _engine = env.start(go_twice(), env.config());
    let base = serve_api(&env, go_twice(), None);
    submit_go_twice(&env, "go2").await;
    let until = wait_for_wait(&env, "go2", "signal").await["until"].clone();
    let one = json!({ "id": "op-1", "payload": 1, "until": until });
    let two = json!({ "id": "op-2", "payload": 2, "until": until });
    let (a, b) = tokio::join!(
        signal(&base, "go2", "go", one),
        signal(&base, "go2", "go", two)
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [202, 409], "{a:?} {b:?}");
    // Decided (the winner recorded for the wait), or — when a node took
    // the winner and closed the wait first — over: refused either way,
    // nothing recorded. (`wait_decided` itself, made certain by a stopped
    // node: `a_decision_with_until_is_refused_for_another_wait_by_client_and_cli`.)
    let refused = if a.0 == 409 { &a.1 } else { &b.1 };
    let code = refused["error"]["code"].as_str().unwrap_or_default();
    assert!(code == "wait_decided" || code == "not_waiting", "{refused}");
    let winner = if a.0 == 202 { 1 } else { 2 };
    let job = env.wait_for("go2", JobState::Acked, WAIT).await;
    assert_eq!(
        job.result.unwrap(),
        json!([winner, null]),
        "the second wait took the first wait's other decision"
    );
    assert_eq!(
        job.signals.len(),
        1,
        "nothing else recorded: {:?}",
        job.signals
    );
}

/// Asks for one approval and returns the decision.
struct AsksOnce;

impl Workflow for AsksOnce {
    const NAME: &'static str = "test.asks_once";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let decision = ctx
            .wait_for_approval("c-1", "refund", &json!({ "order": 7 }), WAIT * 3)
            .await?;
        Ok(json!(decision.map(|d| d.approved)))
    }
}

async fn submit_asks_once(env: &TestEnv, id: &str) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: AsksOnce::NAME.to_owned(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// A `job.waiting` the consumer refused is retried, under its key, while
/// its wait lasts: 503 once, then delivered.
#[actix_rt::test]
async fn a_waiting_event_is_retried_while_its_wait_lasts() {
    use onceflow_engine::testkit::Behaviour;
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(AsksOnce);
    let _engine = env.start(registry, env.config());
    env.consumer
        .push_for("ask-retry", Behaviour::Status(503, Some(1)));
    submit_asks_once(&env, "ask-retry").await;
    let key = "job:ask-retry:waiting:approval:c-1";
    let delivered = wait_until(WAIT, || async {
        env.sql(&format!(
            "SELECT status::text AS s FROM outbox WHERE idempotency_key = '{key}'"
        ))
        .await[0]["s"]
            == "delivered"
    })
    .await;
    assert!(
        delivered,
        "{}",
        env.sql("SELECT status::text, last_error FROM outbox").await
    );
    assert_eq!(
        env.consumer.requests_with_key(key),
        2,
        "503, then delivered"
    );
    assert_eq!(env.consumer.processed_with_key(key), 1);
}

/// "Please approve" is not posted again once the wait is over: a
/// `job.waiting` whose first send failed is closed unsent when the approval
/// is decided (`event_moot`) or the job cancelled before its retry.
#[actix_rt::test]
async fn a_waiting_event_is_not_sent_after_its_wait_is_over() {
    use onceflow_engine::testkit::Behaviour;
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(AsksOnce);
    let _engine = env.start(registry, env.config());
    for id in ["moot-decided", "moot-cancelled"] {
        // The first send fails, and its retry waits two seconds.
        env.consumer.push_for(id, Behaviour::Status(503, Some(2)));
        submit_asks_once(&env, id).await;
    }
    let key = |id: &str| format!("job:{id}:waiting:approval:c-1");
    for id in ["moot-decided", "moot-cancelled"] {
        assert!(
            wait_until(WAIT, || async {
                env.consumer.requests_with_key(&key(id)) == 1
            })
            .await,
            "the first send of {id}'s job.waiting"
        );
    }
    env.store
        .waits()
        .signal(
            "moot-decided",
            "approval:c-1",
            &onceflow_engine::rules::signal::SignalBody::new("d-1", json!({ "approved": true })),
        )
        .await
        .unwrap();
    env.store
        .jobs()
        .cancel("moot-cancelled", "test", "not needed")
        .await
        .unwrap();
    env.wait_for("moot-decided", JobState::Acked, WAIT).await;
    for (id, code) in [
        ("moot-decided", "event_moot"),
        ("moot-cancelled", "cancelled"),
    ] {
        let closed = wait_until(WAIT, || async {
            env.sql(&format!(
                "SELECT status::text AS s, last_error->>'code' AS code FROM outbox \
                 WHERE idempotency_key = '{}'",
                key(id)
            ))
            .await[0]
                == json!({ "s": "dead", "code": code })
        })
        .await;
        assert!(
            closed,
            "{id}: {}",
            env.sql("SELECT idempotency_key, status::text, last_error FROM outbox")
                .await
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for id in ["moot-decided", "moot-cancelled"] {
        assert_eq!(
            env.consumer.requests_with_key(&key(id)),
            1,
            "{id}: sent once, before its wait ended"
        );
    }
}

/// A misspelt name in `"approval"` must not let the tool it meant run
/// unasked: intake refuses it, naming the entry, and a job that got past
/// intake anyway (a node with other tools took it) ends before any tool runs.
#[actix_rt::test]
async fn an_approval_list_naming_no_tool_is_refused_and_fails_closed() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "refund": 7 }))]);
    let base = serve_api(&env, agent_registry(&tools.url()), None);
    let submit = |id: &str, approval: Value| {
        client()
            .post(format!("{base}/v1/jobs"))
            .json(&json!({
                "id": id,
                "workflow": "agent",
                "input": {
                    "model": "m",
                    "messages": [{ "role": "user", "content": "refund order 7" }],
                    "approval": approval,
                },
                "webhook_url": env.consumer.url(),
            }))
            .send()
    };
    let response = submit("ap-typo", json!(["http_post", "http_psot"]))
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["field"], "input.approval[1]", "{body}");
    assert!(
        env.store.jobs().get("ap-typo").await.unwrap().is_none(),
        "nothing stored"
    );
    let response = submit("ap-named", json!(["http_post"])).await.unwrap();
    assert_eq!(
        response.status().as_u16(),
        201,
        "a real tool's name is taken"
    );

    // Past intake (straight into the store): the pinned tool set decides.
    submit_agent(&env, "ap-5", json!(["http_psot"])).await;
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    let job = env.wait_for("ap-5", JobState::Dead, WAIT).await;
    let error = job.last_error.expect("the job's error");
    assert_eq!(error.code, "invalid_input");
    assert!(
        error.message.contains("input.approval[0]"),
        "{}",
        error.message
    );
    assert_eq!(
        env.provider.requests_for("job:ap-5:turn:0"),
        0,
        "no model call"
    );
    assert_eq!(
        tools.requests_with_key("job:ap-5:tool:0:0"),
        0,
        "no tool ran"
    );
}

#[actix_rt::test]
async fn a_cancel_of_a_waiting_job_is_at_once() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "refund": 7 }))]);
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    submit_agent(&env, "ap-4", json!("all")).await;
    wait_for_wait(&env, "ap-4", "approval").await;
    env.store
        .jobs()
        .cancel("ap-4", "test", "changed my mind")
        .await
        .unwrap();
    let job = env.job("ap-4").await;
    assert_eq!(job.state, JobState::Cancelled, "no lease to wait for");
    assert_eq!(job.waiting, None, "a finished job waits for nothing");
    // An approval after the cancel is refused, and nothing runs.
    let approval = json!({ "approved": true });
    let outcome = env
        .store
        .waits()
        .signal(
            "ap-4",
            "approval:call_1",
            &onceflow_engine::rules::signal::SignalBody::new("d-1", approval.clone()),
        )
        .await
        .unwrap();
    assert_eq!(
        outcome,
        onceflow_engine::store::waits::SignalOutcome::Finished
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(tools.requests_with_key("job:ap-4:tool:0:0"), 0);
}

// ---- the real binary: an approval through kill -9 --------------------------

/// `onceflow_actors_in_flight` as the node's `/metrics` reports it.
async fn actors_in_flight(base: &str, token: &str) -> i64 {
    let text = client()
        .get(format!("{base}/metrics"))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix("onceflow_actors_in_flight")?;
            // `onceflow_actors_in_flight 0` or with labels `{…} 0`.
            rest.rsplit(' ').next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no onceflow_actors_in_flight in /metrics:\n{text}"))
}

/// The real `onceflow serve`, killed with SIGKILL while an agent's tool call
/// waits for its approval and again while the approved tool runs: the waiting
/// job holds no actor on either node (`/metrics`), its `job.waiting` event
/// is sent once, and the approved tool runs once.
#[actix_rt::test]
async fn an_approval_survives_kill_9_of_the_real_binary() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_5", json!({ "refund": 5 }))]);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = [
        ("DATABASE_URL", env.db_url.clone()),
        ("OPENAI_BASE_URL", env.provider.base_url()),
        ("ONCEFLOW_TOOL_POST_URL", tools.url()),
        ("ONCEFLOW_POLL_MS", "100".to_owned()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
    ];
    let mut serve = ServeProcess::start(&vars, &log).await;
    let token = env.store.tokens().create("waits", true).await.unwrap();
    let r = client()
        .post(format!("{}/v1/jobs", serve.base))
        .bearer_auth(&token)
        .json(&json!({
            "id": "kill-ap", "workflow": "agent", "webhook_url": env.consumer.url(),
            "input": { "model": "m", "messages": [{ "role": "user", "content": "refund 5" }],
                       "approval": ["http_post"] },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let waiting = wait_for_wait(&env, "kill-ap", "approval").await;
    assert_eq!(waiting["name"], "approval:call_5");
    // Its job.waiting event delivered (and recorded so) before the kill.
    let event_key = "job:kill-ap:waiting:approval:call_5";
    assert!(
        wait_until(WAIT, || async {
            env.sql(&format!(
                "SELECT 1 FROM outbox WHERE idempotency_key = '{event_key}' AND status = 'delivered'"
            ))
            .await
            .as_array()
            .is_some_and(|rows| rows.len() == 1)
        })
        .await,
        "the job.waiting event was not delivered: {}",
        env.sql("SELECT idempotency_key, status FROM outbox").await
    );
    assert_eq!(actors_in_flight(&serve.base, &token).await, 0);

    let attempts = env.job("kill-ap").await.attempts;
    serve.sigkill();
    serve.restart_on_same_port(&vars, &log).await;
    // The new node leaves the waiting job alone: no actor, no lease, not
    // even an attempt that would wait again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(actors_in_flight(&serve.base, &token).await, 0);
    let job = env.job("kill-ap").await;
    assert!(job.waiting.is_some(), "still waiting after the restart");
    assert_eq!(job.attempts, attempts, "the restart ran no attempt");
    assert_eq!(tools.requests_with_key("job:kill-ap:tool:0:0"), 0);
    // The approved tool does its work and holds its answer: the second kill
    // lands before the node hears back.
    tools.push(onceflow_engine::testkit::Behaviour::LoseResponse(
        Duration::from_secs(5),
    ));

    // The approval, through the command line.
    let approve = signal_cli(&serve.base, &token, "d-1", r#"{"approved": true}"#).await;
    assert!(approve.0, "{approve:?}");
    assert!(
        approve.1.contains("recorded for job kill-ap"),
        "{approve:?}"
    );
    // Killed again while the approved tool call is under way.
    assert!(
        wait_until(WAIT, || async {
            tools.requests_with_key("job:kill-ap:tool:0:0") >= 1
        })
        .await,
        "the approval did not wake the job"
    );
    assert_eq!(
        actors_in_flight(&serve.base, &token).await,
        1,
        "the running job holds its actor (the gauge counts it)"
    );
    serve.sigkill();
    assert!(
        !env.job("kill-ap").await.state.is_terminal(),
        "killed mid-way"
    );
    serve.restart_on_same_port(&vars, &log).await;
    let job = env.wait_for("kill-ap", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["tool_calls"], 1);
    assert_eq!(
        tools.processed_with_key("job:kill-ap:tool:0:0"),
        1,
        "the approved tool's effect happened once"
    );
    assert_eq!(
        tools.requests_with_key("job:kill-ap:tool:0:0"),
        2,
        "the tool call cut by the kill was sent again under its key"
    );
    assert_eq!(
        env.consumer.requests_with_key(event_key),
        1,
        "one job.waiting, through two kills"
    );
    assert_eq!(env.consumer.processed_for("kill-ap"), 2);
    assert_eq!(
        env.provider.work_done("job:kill-ap:turn:0"),
        1,
        "the first model turn was paid once"
    );
    assert_eq!(actors_in_flight(&serve.base, &token).await, 0);

    // The same approval again is the same signal; the same id with another
    // payload, or a new signal for the finished job, is refused and says why.
    let again = signal_cli(&serve.base, &token, "d-1", r#"{"approved": true}"#).await;
    assert!(again.0 && again.1.contains("already recorded"), "{again:?}");
    let changed = signal_cli(&serve.base, &token, "d-1", r#"{"approved": false}"#).await;
    assert!(
        !changed.0 && changed.1.contains("signal_conflict"),
        "{changed:?}"
    );
    let late = signal_cli(&serve.base, &token, "d-2", r#"{"approved": true}"#).await;
    assert!(!late.0 && late.1.contains("job_finished"), "{late:?}");
    let bad = signal_cli(&serve.base, &token, "d-3", "{approved").await;
    assert!(!bad.0 && bad.1.contains("--payload is not JSON"), "{bad:?}");
    let signals = env.job("kill-ap").await.signals;
    assert_eq!(signals.len(), 1, "recorded once: {signals:?}");
    assert_eq!(signals[0].payload, json!({ "approved": true }));
}

/// `onceflow signal kill-ap approval:call_5 --id ID --payload JSON` against
/// `base`, the token in `ONCEFLOW_TOKEN`: (exited 0, stdout and stderr).
async fn signal_cli(base: &str, token: &str, id: &str, payload: &str) -> (bool, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"));
    command
        .args(["signal", "kill-ap", "approval:call_5", "--id", id])
        .args(["--payload", payload, "--server", base])
        .env("ONCEFLOW_TOKEN", token);
    let out = tokio::task::spawn_blocking(move || command.output().expect("onceflow signal"))
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

// ---- bad input loses nothing ----------------------------------------------

/// Waits for a number.
struct Counter;

impl Workflow for Counter {
    const NAME: &'static str = "test.counter";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let n: Option<u32> = ctx.wait_for_signal("n", Duration::from_secs(60)).await?;
        Ok(json!({ "n": n }))
    }
}

/// A signal whose payload does not fit the wait's type fails the job with
/// `invalid_signal` (permanent: no retry loop), and a signal of a name the
/// job never waits for is kept and shown in its detail.
#[actix_rt::test]
async fn a_signal_that_does_not_fit_is_invalid_signal_and_a_stray_one_is_kept() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(Counter);
    let _engine = env.start(registry, env.config());
    for id in ["ct-1", "ct-2"] {
        env.submit_job(NewJob {
            tags: Default::default(),
            id: id.to_owned(),
            workflow: Counter::NAME.to_owned(),
            workflow_version: 1,
            input: json!({}),
            webhook_url: env.consumer.url(),
            schedule: Default::default(),
        })
        .await;
        wait_for_wait(&env, id, "signal").await;
    }
    env.store
        .waits()
        .signal(
            "ct-1",
            "stray",
            &onceflow_engine::rules::signal::SignalBody::new("s-0", json!({ "kept": true })),
        )
        .await
        .unwrap();
    env.store
        .waits()
        .signal(
            "ct-1",
            "n",
            &onceflow_engine::rules::signal::SignalBody::new("s-1", json!(7)),
        )
        .await
        .unwrap();
    let job = env.wait_for("ct-1", JobState::Acked, WAIT).await;
    assert_eq!(job.result.unwrap()["n"], 7);
    let kept: Vec<_> = job
        .signals
        .iter()
        .map(|s| (s.name.as_str(), s.taken_by.clone()))
        .collect();
    assert_eq!(
        kept,
        vec![("stray", None), ("n", Some("job:ct-1:signal:n".to_owned()))]
    );

    env.store
        .waits()
        .signal(
            "ct-2",
            "n",
            &onceflow_engine::rules::signal::SignalBody::new("s-1", json!("seven")),
        )
        .await
        .unwrap();
    let job = env.wait_for("ct-2", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "invalid_signal");
    assert_eq!(job.attempts, 2, "a permanent failure: no retries");
}

/// An idle node — a job waiting an hour, another finished, nothing due —
/// issues no statement but its timer poll (the acquire), at most one per
/// poll interval. Counted by the database itself (`pg_stat_statements`)
/// over 100 poll intervals: longer than any housekeeping cadence a node
/// ever kept (gauges every 30 polls; the purge, the failure-event sweep and
/// the schedules check every 60), so a timer of its own would show.
#[actix_rt::test]
async fn an_idle_node_issues_only_its_timer_poll() {
    use onceflow_engine::db::{self, Db};
    use onceflow_engine::faults::Faults;
    use onceflow_engine::pg::{Durability, EmbeddedPg};
    use onceflow_engine::store::Store;
    use onceflow_engine::testkit::{FakeConsumer, FakeProvider};
    // A server of its own with pg_stat_statements loaded (the shared test
    // server runs without it).
    let pg = EmbeddedPg::throwaway().expect("start PostgreSQL");
    pg.stop().expect("stop the fast server");
    pg.restart(Durability::Durable)
        .expect("start PostgreSQL with pg_stat_statements");
    db::create_database(&pg.url("postgres"), "idle", None)
        .await
        .unwrap();
    let conn = Db::connect(&pg.url("idle"), 8).await.unwrap();
    conn.migrate().await.unwrap();
    let env = TestEnv {
        db_url: pg.url("idle"),
        store: Store::new(conn),
        provider: FakeProvider::start(),
        consumer: FakeConsumer::start(),
        faults: Faults::new(),
        hub: Default::default(),
    };
    env.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await;

    let acted = Arc::new(AtomicU32::new(0));
    let config = env.config();
    let poll = config.poll_interval;
    let _engine = env.start(registry(&acted), config);
    submit(&env, "idle-done", 0, 1).await;
    env.wait_for("idle-done", JobState::Acked, WAIT).await;
    submit(&env, "idle-sleeper", 3_600_000, 1).await;
    wait_for_wait(&env, "idle-sleeper", "sleep").await;
    // What the start and the two jobs set going settles, then the count
    // starts from zero.
    tokio::time::sleep(poll * 10).await;
    env.execute(
        "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)",
    )
    .await;
    let window = poll * 100;
    tokio::time::sleep(window).await;
    let ran = env
        .sql(
            "SELECT s.calls, s.query FROM pg_stat_statements s \
             JOIN pg_database d ON d.oid = s.dbid \
             WHERE d.datname = current_database() AND s.query NOT LIKE '%pg_stat_statements%' \
             ORDER BY s.calls DESC",
        )
        .await;
    let ran = ran.as_array().expect("rows");
    let acquire = |q: &str| q.contains("UPDATE waits w SET outcome");
    let others: Vec<&Value> = ran
        .iter()
        .filter(|r| !acquire(r["query"].as_str().unwrap_or_default()))
        .collect();
    assert!(
        others.is_empty(),
        "an idle node ran statements besides its timer poll: {others:#?}"
    );
    let polls: i64 = ran.iter().map(|r| r["calls"].as_i64().unwrap()).sum();
    assert!(polls >= 1, "the timer poll ran over {window:?}: {ran:#?}");
    // At most one per interval (a little slack for the window's edges).
    assert!(polls <= 105, "{polls} timer polls in 100 poll intervals");
    assert_eq!(acted.load(Ordering::SeqCst), 1, "only idle-done acted");
    drop(_engine);
    pg.stop().expect("stop PostgreSQL");
}

/// A decision for one wait, sent while the job waits and no node runs (so
/// nothing is taken), through the typed `Client::signal_for_wait` and the
/// `onceflow signal --until` command: a stale `until` is `409 not_waiting`
/// and records nothing; the wait's own `until` is recorded; a second
/// decision for it is `409 wait_decided`, and so is one sent after an
/// untimed signal of that name that waits to be taken. A bad `until` is
/// `422` naming it. When a node runs again, each job's first wait takes
/// its one signal and the second wait times out.
#[actix_rt::test]
async fn a_decision_with_until_is_refused_for_another_wait_by_client_and_cli() {
    use onceflow::{Client, ClientError};
    let env = TestEnv::new().await;
    let engine = env.start(go_twice(), env.config());
    let base = serve_api(&env, go_twice(), None);
    for id in ["typed", "cli", "untimed"] {
        submit_go_twice(&env, id).await;
    }
    let mut untils = std::collections::HashMap::new();
    for id in ["typed", "cli", "untimed"] {
        let until = wait_for_wait(&env, id, "signal").await["until"]
            .as_str()
            .unwrap()
            .to_owned();
        untils.insert(id, until);
    }
    engine.shutdown();
    let stale = |until: &str| {
        let at =
            chrono::DateTime::parse_from_rfc3339(until).unwrap() + chrono::Duration::seconds(1);
        at.to_rfc3339()
    };

    // The typed client.
    let client = Client::new(&base);
    let until = untils["typed"].as_str();
    match client
        .signal_for_wait("typed", "go", "t-0", &json!(0), Some(&stale(until)))
        .await
    {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "not_waiting"),
        other => panic!("a stale until: {other:?}"),
    }
    match client
        .signal_for_wait("typed", "go", "t-0", &json!(0), Some("tomorrow"))
        .await
    {
        Err(ClientError::Invalid { field, .. }) => assert_eq!(field, "until"),
        other => panic!("a bad until: {other:?}"),
    }
    let recorded = client
        .signal_for_wait("typed", "go", "t-1", &json!(1), Some(until))
        .await
        .unwrap();
    assert!(recorded, "the wait's own until is recorded");
    match client
        .signal_for_wait("typed", "go", "t-2", &json!(2), Some(until))
        .await
    {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "wait_decided"),
        other => panic!("a second decision: {other:?}"),
    }

    // The command line.
    let cli = |id: &str, until: String| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"));
        command
            .args(["signal", "cli", "go", "--id", id, "--payload", "5"])
            .args(["--until", &until, "--server", &base]);
        async move {
            let out = tokio::task::spawn_blocking(move || command.output().unwrap())
                .await
                .unwrap();
            (
                out.status.success(),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            )
        }
    };
    let (ok, text) = cli("c-0", stale(&untils["cli"])).await;
    assert!(!ok && text.contains("not_waiting"), "{text}");
    let (ok, text) = cli("c-1", untils["cli"].clone()).await;
    assert!(ok && text.contains("recorded"), "{text}");
    let (ok, text) = cli("c-2", untils["cli"].clone()).await;
    assert!(!ok && text.contains("wait_decided"), "{text}");

    // An untimed signal kept for the wait decides it too.
    let (status, body) = signal(
        &base,
        "untimed",
        "go",
        json!({ "id": "free", "payload": 9 }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = signal(
        &base,
        "untimed",
        "go",
        json!({ "id": "late", "payload": 10, "until": untils["untimed"] }),
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("wait_decided")),
        "{body}"
    );

    let _again = env.start(go_twice(), env.config());
    for (id, first) in [("typed", 1), ("cli", 5), ("untimed", 9)] {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert_eq!(job.result.unwrap(), json!([first, null]), "{id}");
        assert_eq!(job.signals.len(), 1, "{id}: {:?}", job.signals);
    }
}
