//! Priorities and delays: `priority` (higher first among due jobs),
//! `run_at` or `delay_ms` (not before), each part of the request an
//! identical resubmission must match.

use std::time::Duration;

use onceflow_engine::testkit::TestEnv;
use onceflow_engine::{JobState, Registry};
use onceflow_workflows::Completion;
use serde_json::{json, Value};

use crate::support::{post_job, serve_api};

const WAIT: Duration = Duration::from_secs(20);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

fn job(env: &TestEnv, id: &str, extra: Value) -> Value {
    let mut body = json!({
        "id": id, "workflow": "completion", "webhook_url": env.consumer.url(),
        "input": { "model": "m", "messages": [{ "role": "user", "content": id }] },
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[actix_rt::test]
async fn bad_schedules_are_refused_naming_the_field_and_the_schedule_is_part_of_the_request() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, registry(), None);
    for (extra, field) in [
        (
            json!({"run_at": "2030-01-01T00:00:00Z", "delay_ms": 10}),
            "delay_ms",
        ),
        (json!({"run_at": "tomorrow"}), "run_at"),
        (json!({"run_at": 1767225600}), "run_at"),
        (json!({"delay_ms": -1}), "delay_ms"),
        (json!({"delay_ms": 1.5}), "delay_ms"),
        (json!({"delay_ms": 2_592_000_001_u64}), "delay_ms"),
        (json!({"priority": "high"}), "priority"),
        (json!({"priority": 4_294_967_296_u64}), "priority"),
        (json!({"run_at": "2030-01-01T00:00:00Z"}), "run_at"),
    ] {
        let (status, body) = post_job(&base, &job(&env, "sched-bad", extra.clone())).await;
        assert_eq!(status, 422, "{extra}: {body}");
        assert_eq!(body["error"]["field"], field, "{extra}: {body}");
    }
    let stored = env.sql("SELECT count(*) AS n FROM jobs").await;
    assert_eq!(stored[0]["n"], 0, "nothing refused was stored");

    let delayed = json!({"delay_ms": 60_000, "priority": 3});
    let (status, first) = post_job(&base, &job(&env, "sched-1", delayed.clone())).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["priority"], 3);
    let (status, _) = post_job(&base, &job(&env, "sched-1", delayed)).await;
    assert_eq!(status, 200, "an identical resubmission");
    for other in [
        json!({"delay_ms": 60_001, "priority": 3}),
        json!({"delay_ms": 60_000, "priority": 4}),
        json!({"delay_ms": 60_000}),
        json!({"run_at": (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339(), "priority": 3}),
    ] {
        let (status, body) = post_job(&base, &job(&env, "sched-1", other.clone())).await;
        assert_eq!(status, 409, "{other}: {body}");
    }
    // A request without a schedule hashes as before the schedule existed.
    let (status, _) = post_job(&base, &job(&env, "plain-1", json!({}))).await;
    assert_eq!(status, 201);
    let (status, _) = post_job(&base, &job(&env, "plain-1", json!({"priority": 0}))).await;
    assert_eq!(status, 200, "priority 0 is the default");
}

#[actix_rt::test]
async fn a_delayed_job_starts_at_its_time_even_across_a_restart() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, registry(), None);
    let first = env.start(registry(), env.config());
    let (status, body) = post_job(&base, &job(&env, "later-1", json!({"delay_ms": 1500}))).await;
    assert_eq!(status, 201, "{body}");
    let at = chrono::DateTime::parse_from_rfc3339(body["run_at"].as_str().unwrap()).unwrap();
    let created =
        chrono::DateTime::parse_from_rfc3339(body["created_at"].as_str().unwrap()).unwrap();
    assert_eq!(
        (at - created).num_milliseconds(),
        1500,
        "due 1.5 s after intake"
    );
    // The node that took it in goes away before it is due; another runs it.
    first.shutdown();
    let _second = env.start(registry(), env.config());
    let job = env.wait_for("later-1", JobState::Acked, WAIT).await;
    assert_eq!(job.attempts, 1, "never leased before it was due");
    let started = job
        .history
        .iter()
        .find(|h| h.state == JobState::Generated)
        .expect("a generated row")
        .at;
    assert!(
        started >= at,
        "the model was called at {started}, before the job was due at {at}"
    );
    assert_eq!(env.provider.requests_for("job:later-1:generate"), 1);
    assert_eq!(env.consumer.processed_for("later-1"), 1);
}

#[actix_rt::test]
async fn a_higher_priority_job_runs_first() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, registry(), None);
    // Queued before any node runs: three ordinary jobs, then an urgent one.
    for id in ["low-1", "low-2", "low-3"] {
        let (status, _) = post_job(&base, &job(&env, id, json!({}))).await;
        assert_eq!(status, 201);
    }
    let (status, _) = post_job(&base, &job(&env, "urgent", json!({"priority": 10}))).await;
    assert_eq!(status, 201);
    // One job at a time, so the order of model calls is the order of leases.
    let mut config = env.config();
    config.max_in_flight = 1;
    let _engine = env.start(registry(), config);
    for id in ["low-1", "low-2", "low-3", "urgent"] {
        env.wait_for(id, JobState::Acked, WAIT).await;
    }
    let order: Vec<String> = env
        .provider
        .requests()
        .iter()
        .filter_map(|r| r.idempotency_key.clone())
        .collect();
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(order[0], "job:urgent:generate", "{order:?}");
    assert_eq!(
        &order[1..],
        [
            "job:low-1:generate",
            "job:low-2:generate",
            "job:low-3:generate"
        ],
        "equal priorities in submission order: {order:?}"
    );
}
