//! One trace per job: the trace context stored at intake is carried by every
//! attempt's outgoing requests, to the provider and to the consumer.

use std::collections::HashSet;
use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::rules::traceparent::TraceParent;
use onceflow_engine::testkit::{Behaviour, TestEnv};
use onceflow_engine::JobState;
use serde_json::json;

use crate::support::{client, serve_api};

const WAIT: Duration = Duration::from_secs(20);

/// (trace id, span id) of every `traceparent` the fakes saw for `id`.
fn seen(env: &TestEnv, id: &str) -> Vec<(String, String)> {
    let key = format!("job:{id}:");
    let provider = env
        .provider
        .requests()
        .into_iter()
        .filter(|r| {
            r.idempotency_key
                .as_deref()
                .is_some_and(|k| k.starts_with(&key))
        })
        .map(|r| r.traceparent);
    let consumer = env
        .consumer
        .deliveries_for(id)
        .into_iter()
        .map(|d| d.traceparent);
    provider
        .chain(consumer)
        .map(|tp| {
            let tp = TraceParent::parse(&tp.expect("a traceparent on every request"))
                .expect("a valid traceparent");
            (tp.trace_id_hex(), hex::encode(tp.span_id))
        })
        .collect()
}

#[actix_rt::test]
async fn every_attempt_continues_the_callers_trace() {
    let env = TestEnv::new().await;
    let registry = onceflow_workflows::registry();
    let base = serve_api(&env, registry.clone(), None);
    // One lost provider answer and one failed webhook: three attempts in all.
    env.faults
        .arm_once("traced-1", FailPoint::ModelAfterSend, Action::Fail);
    env.consumer
        .push_for("traced-1", Behaviour::Status(503, None));
    let _engine = env.start(registry, env.config());

    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let body = json!({
        "id": "traced-1", "workflow": "completion", "webhook_url": env.consumer.url(),
        "input": { "model": "m", "messages": [{ "role": "user", "content": "hi" }] },
    });
    let response = client()
        .post(format!("{base}/v1/jobs"))
        .header("traceparent", caller)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let job = env.wait_for("traced-1", JobState::Acked, WAIT).await;
    assert_eq!(job.attempts, 3);
    assert_eq!(
        job.trace_id.as_deref(),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );

    let seen = seen(&env, "traced-1");
    assert_eq!(
        seen.len(),
        4,
        "2 model requests and 2 webhook requests: {seen:?}"
    );
    for (trace, _) in &seen {
        assert_eq!(trace, "4bf92f3577b34da6a3ce929d0e0e4736");
    }
    // Each send is a span of its own (spans are not recorded here, export
    // being off, yet each request names its own), none of them the caller's.
    let spans: HashSet<&String> = seen.iter().map(|(_, s)| s).collect();
    assert_eq!(spans.len(), 4, "{seen:?}");
    assert!(!spans.contains(&"00f067aa0ba902b7".to_owned()));
}

#[actix_rt::test]
async fn a_job_without_a_caller_trace_gets_its_own() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("traced-2", FailPoint::AfterCommit("claimed"), Action::Crash);
    let _engine = env.start(onceflow_workflows::registry(), env.config());
    let created = env.submit("traced-2", "hello").await;
    let job = env.wait_for("traced-2", JobState::Acked, WAIT).await;
    assert!(
        env.faults
            .fired_at("traced-2", FailPoint::AfterCommit("claimed")),
        "the crash after the claim fired"
    );
    assert!(
        job.attempts >= 2,
        "resumed by a second attempt: {}",
        job.attempts
    );
    let trace = job.trace_id.clone().expect("a trace id");
    assert_eq!(created.trace_id, job.trace_id);
    let seen = seen(&env, "traced-2");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|(t, _)| *t == trace), "{seen:?}");
    assert_ne!(seen[0].1, seen[1].1, "the resumed attempt is another span");
}
