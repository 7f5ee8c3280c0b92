//! Operating it: a graceful drain of the real binary.

use std::time::{Duration, Instant};

use onceflow_engine::testkit::{wait_until, TestEnv};
use serde_json::{json, Value};

use crate::support::{client, get, post_job, ServeProcess};

fn job(id: &str, hook: &str) -> Value {
    json!({
        "id": id, "workflow": "completion", "webhook_url": hook,
        "input": { "model": "m", "messages": [{ "role": "user", "content": id }] },
    })
}

/// Two `serve` processes on one database with a 30 s lease; jobs mid model
/// call (2 s) on the first; SIGTERM: it answers 503 meanwhile, finishes and
/// records its calls, hands its leases over and exits 0; the second acks
/// every job within 5 s; the provider saw one request per job.
#[actix_rt::test]
async fn sigterm_drains_and_hands_jobs_over_without_paying_twice() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(2));
    let dir = tempfile::tempdir().unwrap();
    let common = |node: &str| {
        vec![
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_LEASE_MS", "30000".to_owned()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
            ("ONCEFLOW_MODEL_TIMEOUT_MS", "10000".to_owned()),
            ("ONCEFLOW_NODE_ID", node.to_owned()),
        ]
    };
    let mut first = ServeProcess::start(&common("first"), &dir.path().join("first.log")).await;
    let ids: Vec<String> = (0..6).map(|i| format!("drain-{i}")).collect();
    for id in &ids {
        let (status, body) = post_job(&first.base, &job(id, &env.consumer.url())).await;
        assert_eq!(status, 201, "{body}");
    }
    // Every job is mid model call on the first node before the second starts.
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.provider.requests().len() == ids.len()
        })
        .await
    );
    let second = ServeProcess::start(&common("second"), &dir.path().join("second.log")).await;
    let leased = env
        .sql("SELECT count(*) AS n FROM jobs WHERE lease_owner = 'first'")
        .await;
    assert_eq!(
        leased[0]["n"],
        ids.len() as i64,
        "the first node holds them all"
    );

    let pid = nix::unistd::Pid::from_raw(first.child.id() as i32);
    let signalled = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::SIGTERM).unwrap();
    // While it drains, it takes no new work and says so.
    let answered_503 = wait_until(Duration::from_secs(2), || async {
        let r = client()
            .post(format!("{}/v1/jobs", first.base))
            .json(&job("late-1", &env.consumer.url()))
            .send()
            .await;
        match r {
            Ok(r) => r.status().as_u16() == 503 && r.headers().contains_key("retry-after"),
            Err(_) => false,
        }
    })
    .await;
    assert!(
        answered_503,
        "intake answered 503 with Retry-After while draining"
    );
    let (health, _) = get(&format!("{}/healthz", first.base)).await;
    assert_eq!(health, 503, "/healthz answers 503 while draining");
    let status = first.child.wait().unwrap();
    assert!(status.success(), "the draining node exits 0: {status}");

    let all_acked = wait_until(
        Duration::from_secs(5).saturating_sub(signalled.elapsed()),
        || async {
            let mut acked = 0;
            for id in &ids {
                if get(&format!("{}/v1/jobs/{id}", second.base)).await.1["state"] == "acked" {
                    acked += 1;
                }
            }
            acked == ids.len()
        },
    )
    .await;
    assert!(
        all_acked,
        "every job acked by the second node within 5 s of SIGTERM; first log:\n{}",
        std::fs::read_to_string(dir.path().join("first.log")).unwrap_or_default()
    );
    for id in &ids {
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:generate")),
            1,
            "{id}: one model request, whatever the deploy"
        );
        let keys: std::collections::HashSet<_> = env
            .consumer
            .deliveries_for(id)
            .into_iter()
            .map(|d| d.webhook_id)
            .collect();
        assert_eq!(keys.len(), 1, "{id}: one delivery key");
        assert_eq!(env.consumer.processed_for(id), 1, "{id}");
        let (_, stored) = get(&format!("{}/v1/jobs/{id}", second.base)).await;
        let history = stored["history"].as_array().unwrap();
        assert_eq!(history.last().unwrap()["worker"], "second", "{stored}");
    }
    assert!(
        env.store.job("late-1").await.unwrap().is_none(),
        "no job taken while draining"
    );
}
