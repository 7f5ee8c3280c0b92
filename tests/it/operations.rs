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

fn list_api(env: &TestEnv, auth: onceflow_engine::api::Auth) -> String {
    let mut registry = onceflow_engine::Registry::new();
    registry.register(onceflow_workflows::Completion::default());
    crate::support::serve_api_state(onceflow_engine::api::ApiState {
        store: env.store.clone(),
        registry,
        body_limit: onceflow_engine::api::DEFAULT_BODY_LIMIT,
        telemetry: std::sync::Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        hosts: onceflow_engine::api::Hosts::Any,
        auth,
        limits: Default::default(),
        draining: Default::default(),
    })
}

async fn get_as(url: &str, token: Option<&str>) -> (u16, Value) {
    let mut r = client().get(url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn ids_of(page: &Value) -> Vec<String> {
    page["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect()
}

/// `GET /v1/jobs`: newest first, keyset pages that neither repeat nor skip
/// when jobs arrive between them, filters, and a token sees its own jobs;
/// `GET /v1/stats` counts every state.
#[actix_rt::test]
async fn jobs_are_listed_newest_first_in_stable_pages() {
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Tokens { loopback: true });
    let alice = env.store.create_token("alice", false).await.unwrap();
    let admin = env.store.create_token("ops", true).await.unwrap();
    let hook = env.consumer.url();
    for i in 0..7 {
        let r = client()
            .post(format!("{base}/v1/jobs"))
            .bearer_auth(&alice)
            .json(&job(&format!("list-{i}"), &hook))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
    }
    // Someone else's job: alice never sees it.
    let r = client()
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(&admin)
        .json(&job("ops-1", &hook))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);

    let (status, first) = get_as(&format!("{base}/v1/jobs?limit=3"), Some(&alice)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(ids_of(&first), ["list-6", "list-5", "list-4"]);
    // A job arriving between pages does not shift them.
    let r = client()
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(&alice)
        .json(&job("list-7", &hook))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let cursor = first["next_cursor"].as_str().unwrap();
    let (_, second) = get_as(
        &format!("{base}/v1/jobs?limit=3&cursor={cursor}"),
        Some(&alice),
    )
    .await;
    assert_eq!(ids_of(&second), ["list-3", "list-2", "list-1"]);
    let cursor = second["next_cursor"].as_str().unwrap();
    let (_, third) = get_as(
        &format!("{base}/v1/jobs?limit=3&cursor={cursor}"),
        Some(&alice),
    )
    .await;
    assert_eq!(ids_of(&third), ["list-0"]);
    assert_eq!(third["next_cursor"], Value::Null);

    // Filters, and the admin's view of everything.
    env.execute("UPDATE jobs SET state = 'dead', dead_reason = 'test', finished_at = now() WHERE id = 'list-2'")
        .await;
    let (_, dead) = get_as(&format!("{base}/v1/jobs?state=dead"), Some(&alice)).await;
    assert_eq!(ids_of(&dead), ["list-2"]);
    assert_eq!(dead["jobs"][0]["dead_reason"], "test");
    let (_, all) = get_as(&format!("{base}/v1/jobs?limit=500"), Some(&admin)).await;
    assert_eq!(ids_of(&all).len(), 9);
    let (_, none) = get_as(&format!("{base}/v1/jobs?workflow=agent"), Some(&admin)).await;
    assert!(ids_of(&none).is_empty());
    for (query, field) in [
        ("state=running", "state"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("since=yesterday", "since"),
        ("cursor=bm9wZQ", "cursor"),
    ] {
        let (status, body) = get_as(&format!("{base}/v1/jobs?{query}"), Some(&alice)).await;
        assert_eq!(
            (status, body["error"]["field"].clone()),
            (422, json!(field)),
            "{query}"
        );
    }
    let (status, _) = get_as(&format!("{base}/v1/jobs"), None).await;
    assert_eq!(status, 401);

    let (_, mine) = get_as(&format!("{base}/v1/stats"), Some(&alice)).await;
    assert_eq!(mine["states"]["received"], 7);
    assert_eq!(mine["states"]["dead"], 1);
    assert_eq!(mine["states"]["acked"], 0, "every state is present");
    let (_, everyone) = get_as(&format!("{base}/v1/stats"), Some(&admin)).await;
    assert_eq!(everyone["states"]["received"], 8);
}

/// `onceflow jobs --state dead` prints the dead jobs.
#[actix_rt::test]
async fn the_cli_lists_jobs() {
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    for id in ["cli-a", "cli-b"] {
        let (status, _) = post_job(&base, &job(id, &env.consumer.url())).await;
        assert_eq!(status, 201);
    }
    env.execute("UPDATE jobs SET state = 'dead', dead_reason = 'gone for good', finished_at = now() WHERE id = 'cli-b'")
        .await;
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"))
            .args(["jobs", "--state", "dead", "--server", &base])
            .env_remove("ONCEFLOW_TOKEN")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("cli-b") && text.contains("gone for good"),
        "{text}"
    );
    assert!(!text.contains("cli-a"), "{text}");
}
