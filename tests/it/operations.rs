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
    // While it drains, it says so and takes no new work.
    let draining = wait_until(Duration::from_secs(2), || async {
        get(&format!("{}/healthz", first.base)).await.0 == 503
    })
    .await;
    assert!(draining, "/healthz answers 503 while draining");
    let late = client()
        .post(format!("{}/v1/jobs", first.base))
        .json(&job("late-1", &env.consumer.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        late.status().as_u16(),
        503,
        "intake refuses new work while draining"
    );
    assert!(late.headers().contains_key("retry-after"));
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
        env.store.jobs().get("late-1").await.unwrap().is_none(),
        "no job taken while draining"
    );
}

fn list_api(env: &TestEnv, auth: onceflow_engine::api::Auth) -> String {
    let mut registry = onceflow_engine::Registry::new();
    registry.register(onceflow_workflows::Completion::default());
    crate::support::serve_api_with_auth(env, registry, auth)
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
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let admin = env.store.tokens().create("ops", true).await.unwrap();
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
    let base_for_cli = base.clone();
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
    // `onceflow redrive` and `onceflow cancel` act through the same API.
    let run = |args: Vec<String>| async move {
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"))
                .args(args)
                .env_remove("ONCEFLOW_TOKEN")
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    let base = base_for_cli;
    let out = run(vec![
        "redrive".into(),
        "cli-b".into(),
        "--reason".into(),
        "retry it".into(),
        "--server".into(),
        base.clone(),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.job("cli-b").await.state,
        onceflow_engine::JobState::Received
    );
    let out = run(vec![
        "cancel".into(),
        "cli-a".into(),
        "--server".into(),
        base.clone(),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.job("cli-a").await.state,
        onceflow_engine::JobState::Cancelled
    );
    let again = run(vec![
        "redrive".into(),
        "cli-a".into(),
        "--reason".into(),
        "x".into(),
        "--server".into(),
        base,
    ])
    .await;
    assert!(!again.status.success(), "a cancelled job is not dead");
    assert!(String::from_utf8_lossy(&again.stderr).contains("409"));
}

async fn post_action(url: &str, body: Value) -> (u16, Value) {
    let r = client().post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn engine_registry(delivery: onceflow_engine::DeliveryPolicy) -> onceflow_engine::Registry {
    let mut r = onceflow_engine::Registry::new();
    r.register(onceflow_workflows::Completion::with_delivery(delivery));
    r
}

/// Cancel: a job mid model call ends `cancelled`; the call may finish but
/// nothing more is recorded or sent; repeats are no-ops; a finished job is 409.
#[actix_rt::test]
async fn a_cancelled_job_starts_nothing_more() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(1500));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(10);
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        config,
    );
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    env.submit("cancel-1", "hello").await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.provider.requests().len() == 1
        })
        .await
    );
    let (status, view) = post_action(
        &format!("{base}/v1/jobs/cancel-1/cancel"),
        json!({"reason": "customer withdrew"}),
    )
    .await;
    assert_eq!(status, 202, "{view}");
    assert_eq!(view["state"], "cancelled");
    assert_eq!(cancels_counted(&base).await, 1, "a transition, counted");
    // The call in flight finishes; nothing is journaled, claimed or sent.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let job = env.job("cancel-1").await;
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(env.provider.requests().len(), 1);
    assert_eq!(
        env.consumer.deliveries().len(),
        0,
        "no webhook after the cancel"
    );
    let journaled = env
        .sql("SELECT status::text AS status FROM model_calls WHERE job_id = 'cancel-1'")
        .await;
    assert_eq!(
        journaled[0]["status"], "pending",
        "the late answer was not recorded"
    );
    let last = job.history.last().unwrap();
    assert_eq!(last.state, JobState::Cancelled);
    assert_eq!(last.note.as_deref(), Some("customer withdrew"));
    assert_eq!(job.last_error.unwrap().code, "cancelled");
    // Idempotent; a finished job cannot be cancelled; an unknown one is 404.
    assert_eq!(
        post_action(&format!("{base}/v1/jobs/cancel-1/cancel"), json!({}))
            .await
            .0,
        202
    );
    env.submit("done-1", "hello").await;
    env.wait_for("done-1", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(
        post_action(&format!("{base}/v1/jobs/done-1/cancel"), json!({}))
            .await
            .0,
        409
    );
    assert_eq!(
        post_action(&format!("{base}/v1/jobs/nobody/cancel"), json!({}))
            .await
            .0,
        404
    );
    let history_count = env.sql("SELECT count(*) AS n FROM job_history WHERE job_id = 'cancel-1' AND state = 'cancelled'").await;
    assert_eq!(history_count[0]["n"], 1, "the repeat wrote nothing");
    assert_eq!(cancels_counted(&base).await, 1, "the repeat is not counted");
}

/// The node's `onceflow.transitions` count of cancels, from its `/metrics`.
async fn cancels_counted(base: &str) -> u64 {
    crate::support::get_text(&format!("{base}/metrics"))
        .await
        .lines()
        .find_map(|l| l.strip_prefix("onceflow_transitions_total{onceflow_state=\"cancelled\"} "))
        .map_or(0, |n| n.parse().unwrap())
}

/// Redrive: a job that died at delivery resumes at `claimed` with the same
/// keys (no new model call), once even when redriven twice at once; a job
/// that is not dead is a 409.
#[actix_rt::test]
async fn a_dead_job_is_redriven_from_its_last_checkpoint_once() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.consumer.push(Behaviour::Status(410, None));
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    env.submit("redrive-1", "hello").await;
    env.wait_for("redrive-1", JobState::Dead, Duration::from_secs(20))
        .await;
    let url = format!("{base}/v1/jobs/redrive-1/redrive");
    let (a, b) = tokio::join!(
        post_action(&url, json!({"reason": "consumer fixed"})),
        post_action(&url, json!({"reason": "consumer fixed"})),
    );
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [202, 409], "{a:?} {b:?}");
    let job = env
        .wait_for("redrive-1", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(
        env.provider.requests_for("job:redrive-1:generate"),
        1,
        "no second model call"
    );
    let deliveries = env.consumer.deliveries_for("redrive-1");
    assert_eq!(deliveries.len(), 2);
    assert!(deliveries
        .iter()
        .all(|d| d.webhook_id.as_deref() == Some("job:redrive-1:completed")));
    assert_eq!(env.consumer.processed_for("redrive-1"), 1);
    let redrives: Vec<_> = job
        .history
        .iter()
        .filter(|h| h.note.as_deref() == Some("redrive: consumer fixed"))
        .collect();
    assert_eq!(
        redrives.len(),
        1,
        "one redrive in the history: {:#?}",
        job.history
    );
    assert_eq!(redrives[0].state, JobState::Claimed);
    assert_eq!(
        post_action(&url, json!({})).await.0,
        409,
        "an acked job is not dead"
    );
}

/// At-most-once: a dead job whose delivery is `unknown` is re-sent only with
/// an explicit confirmation, under the same webhook-id.
#[actix_rt::test]
async fn an_unknown_delivery_is_resent_only_when_confirmed() {
    use onceflow_engine::faults::{Action, FailPoint};
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.faults
        .arm_once("amo-r", FailPoint::WebhookAfterSend, Action::Crash);
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtMostOnce),
        env.config(),
    );
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    env.submit("amo-r", "hello").await;
    let job = env
        .wait_for("amo-r", JobState::Dead, Duration::from_secs(20))
        .await;
    assert_eq!(job.delivery.unwrap().status, "unknown");
    let url = format!("{base}/v1/jobs/amo-r/redrive");
    let (status, body) = post_action(&url, json!({"reason": "checked with the consumer"})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "delivery_unknown");
    assert_eq!(env.job("amo-r").await.state, JobState::Dead);
    let (status, _) = post_action(
        &format!("{url}?confirm_unknown=true"),
        json!({"reason": "checked"}),
    )
    .await;
    assert_eq!(status, 202);
    env.wait_for("amo-r", JobState::Acked, Duration::from_secs(20))
        .await;
    let ids: Vec<_> = env
        .consumer
        .deliveries_for("amo-r")
        .into_iter()
        .map(|d| d.webhook_id)
        .collect();
    assert_eq!(
        ids,
        [
            Some("job:amo-r:completed".to_owned()),
            Some("job:amo-r:completed".to_owned())
        ]
    );
}

/// Bulk redrive: every dead job of a filter, with a count.
#[actix_rt::test]
async fn dead_jobs_are_redriven_in_bulk() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    for _ in 0..3 {
        env.provider.push(Behaviour::Status(400, None));
    }
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let ids = ["bulk-0", "bulk-1", "bulk-2"];
    for id in ids {
        env.submit(id, "hello").await;
        env.wait_for(id, JobState::Dead, Duration::from_secs(20))
            .await;
    }
    let (status, body) = post_action(
        &format!("{base}/v1/jobs/redrive"),
        json!({"reason": "provider fixed", "workflow": "completion"}),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["redriven"], 3);
    for id in ids {
        env.wait_for(id, JobState::Acked, Duration::from_secs(20))
            .await;
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:generate")),
            2,
            "{id}: the refused call and one more"
        );
        assert_eq!(env.consumer.processed_for(id), 1);
    }
}

async fn submit_notifying(env: &TestEnv, id: &str, notify: bool) {
    let job = onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    };
    let created = env
        .store
        .jobs()
        .submit(&onceflow_engine::store::Submission::new(&job).owned(None, notify))
        .await
        .unwrap()
        .intake;
    assert!(matches!(
        created,
        onceflow_engine::store::Intake::Created(_)
    ));
}

/// A `job.dead` whose job was redriven before the event got through is
/// closed unsent (`event_moot`), never posted about a job that is alive.
#[actix_rt::test]
async fn a_dead_event_is_not_sent_after_a_redrive() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    // The first send fails, and its retry waits two seconds.
    env.consumer
        .push_for("dead-again", Behaviour::Status(503, Some(2)));
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    submit_notifying(&env, "dead-again", true).await;
    env.wait_for("dead-again", JobState::Dead, Duration::from_secs(20))
        .await;
    let key = "job:dead-again:dead";
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.consumer.requests_with_key(key) == 1
        })
        .await,
        "the first send of job.dead"
    );
    env.store
        .jobs()
        .redrive("dead-again", "test", "fixed", false)
        .await
        .unwrap();
    env.wait_for("dead-again", JobState::Acked, Duration::from_secs(20))
        .await;
    let closed = wait_until(Duration::from_secs(10), || async {
        env.sql(&format!(
            "SELECT status::text AS s, last_error->>'code' AS code FROM outbox WHERE idempotency_key = '{key}'"
        ))
        .await[0]
            == json!({ "s": "dead", "code": "event_moot" })
    })
    .await;
    assert!(
        closed,
        "{}",
        env.sql("SELECT status::text, last_error FROM outbox").await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.consumer.requests_with_key(key),
        1,
        "nothing sent after the redrive"
    );
}

/// Failure is an event too: a job that asked for it sends `job.dead` /
/// `job.cancelled` under its own stable key, retried like any webhook; a job
/// that did not ask sends nothing.
#[actix_rt::test]
async fn dead_and_cancelled_jobs_send_their_event_once() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    env.provider.push(Behaviour::Status(400, None));
    env.consumer
        .push_for("fail-ev", Behaviour::Status(503, None));
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    submit_notifying(&env, "fail-ev", true).await;
    env.wait_for("fail-ev", JobState::Dead, Duration::from_secs(20))
        .await;
    submit_notifying(&env, "fail-quiet", false).await;
    env.wait_for("fail-quiet", JobState::Dead, Duration::from_secs(20))
        .await;
    let delivered = wait_until(Duration::from_secs(20), || async {
        env.consumer.processed_for("fail-ev") == 1
    })
    .await;
    assert!(delivered, "{:#?}", env.consumer.deliveries_for("fail-ev"));
    let events = env.consumer.deliveries_for("fail-ev");
    assert_eq!(events.len(), 2, "the 503 was retried once");
    for e in &events {
        assert_eq!(e.webhook_id.as_deref(), Some("job:fail-ev:dead"));
        assert_eq!(e.idempotency_key.as_deref(), Some("job:fail-ev:dead"));
        assert_eq!(e.body["type"], "job.dead");
        assert!(
            e.body["data"]["reason"]
                .as_str()
                .unwrap()
                .contains("refused"),
            "{}",
            e.body
        );
    }
    // The consumer answered before the engine recorded it: wait for the record.
    let recorded = wait_until(Duration::from_secs(10), || async {
        env.sql(
            "SELECT status::text AS status FROM outbox WHERE idempotency_key = 'job:fail-ev:dead'",
        )
        .await[0]["status"]
            == "delivered"
    })
    .await;
    assert!(recorded, "the event's outbox row is recorded delivered");
    // A closed event leaves the range the claim walks (`run_at <= now()` on
    // the due index), however many closed ones the index holds.
    assert_eq!(
        env.sql(
            "SELECT run_at = 'infinity' AS gone FROM outbox WHERE idempotency_key = 'job:fail-ev:dead'",
        )
        .await[0]["gone"],
        true
    );

    // Cancelled: its own event and key.
    env.provider.set_latency(Duration::from_secs(3));
    submit_notifying(&env, "cancel-ev", true).await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.provider
                .requests()
                .iter()
                .any(|r| r.idempotency_key.as_deref() == Some("job:cancel-ev:generate"))
        })
        .await
    );
    // The model answers 3 s after this: the attempt then finishes its call.
    let answered_by = std::time::Instant::now() + Duration::from_millis(3500);
    assert_eq!(
        env.store
            .jobs()
            .cancel("cancel-ev", "test", "no longer needed")
            .await
            .unwrap(),
        onceflow_engine::store::operate::Cancelled::Now
    );
    assert!(
        wait_until(Duration::from_secs(20), || async {
            env.consumer.processed_for("cancel-ev") == 1
        })
        .await
    );
    let event = &env.consumer.deliveries_for("cancel-ev")[0];
    assert_eq!(event.webhook_id.as_deref(), Some("job:cancel-ev:cancelled"));
    assert_eq!(event.body["type"], "job.cancelled");
    assert_eq!(event.body["data"]["reason"], "no longer needed");

    // The quiet one sent nothing, ever; the cancelled one, once its
    // attempt's model call has ended too, nothing but its one event.
    tokio::time::sleep_until(
        answered_by
            .max(std::time::Instant::now() + Duration::from_millis(500))
            .into(),
    )
    .await;
    assert_eq!(env.consumer.deliveries_for("fail-quiet").len(), 0);
    assert_eq!(env.consumer.deliveries_for("fail-ev").len(), 2);
    let cancel_ev: Vec<_> = env
        .consumer
        .deliveries_for("cancel-ev")
        .into_iter()
        .map(|d| d.webhook_id)
        .collect();
    assert_eq!(
        cancel_ev,
        [Some("job:cancel-ev:cancelled".to_owned())],
        "no completion after the cancel"
    );
}

/// Dead letters outlive finished jobs: kept `dead_retention`, so they can
/// still be redriven after acked jobs of the same age are purged.
#[actix_rt::test]
async fn dead_letters_are_kept_longer_than_finished_jobs() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    let mut config = env.config();
    config.retention = Duration::from_secs(3600);
    config.dead_retention = Duration::from_secs(3 * 3600);
    let engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        config,
    );
    env.submit("kept-dead", "hello").await;
    env.wait_for("kept-dead", JobState::Dead, Duration::from_secs(20))
        .await;
    env.submit("gone-acked", "hello").await;
    env.wait_for("gone-acked", JobState::Acked, Duration::from_secs(20))
        .await;
    env.submit("old-dead", "hello").await;
    env.wait_for("old-dead", JobState::Acked, Duration::from_secs(20))
        .await;
    env.execute("UPDATE jobs SET state = 'dead', dead_reason = 'x', finished_at = now(), lease_owner = NULL, lease_expires_at = NULL WHERE id = 'old-dead'").await;
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id IN ('kept-dead', 'gone-acked')")
        .await;
    env.execute("UPDATE jobs SET finished_at = now() - interval '4 hours' WHERE id = 'old-dead'")
        .await;
    // Behind the node's back: its purge is armed for an hour from the
    // finish it saw, so it is told to purge now.
    engine.purge_now();
    let purged = wait_until(Duration::from_secs(20), || async {
        env.store.jobs().get("gone-acked").await.unwrap().is_none()
            && env.store.jobs().get("old-dead").await.unwrap().is_none()
    })
    .await;
    assert!(
        purged,
        "the acked job (past 1 h) and the old dead one (past 3 h) were purged"
    );
    assert_eq!(
        env.job("kept-dead").await.state,
        JobState::Dead,
        "a 2 h old dead letter stays"
    );
}

/// Bulk cancel: `POST /v1/jobs/cancel` cancels the caller's live jobs,
/// oldest first, at most `limit`, each as a single cancel would (nothing of
/// them runs after); a finished job is never touched; a bad filter is a
/// `422` naming it.
#[actix_rt::test]
async fn live_jobs_are_cancelled_in_bulk() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    env.submit("done", "hello").await;
    env.wait_for("done", JobState::Acked, Duration::from_secs(20))
        .await;
    for i in 0..4 {
        let mut later = job(&format!("later-{i}"), &env.consumer.url());
        later["delay_ms"] = json!(3_600_000);
        assert_eq!(post_job(&base, &later).await.0, 201);
    }
    let url = format!("{base}/v1/jobs/cancel");
    for (bad, field) in [
        (json!({ "state": "acked" }), "state"),
        (json!({ "limit": 0 }), "limit"),
        (json!({ "limit": 2.5 }), "limit"),
        (json!({ "tag": "x" }), "tag"),
    ] {
        let (status, body) = post_action(&url, bad.clone()).await;
        assert_eq!(
            (status, body["error"]["field"].as_str()),
            (422, Some(field)),
            "{bad}"
        );
    }
    let (status, body) = post_action(&url, json!({ "reason": "tidy", "limit": 3 })).await;
    assert_eq!((status, &body), (202, &json!({ "cancelled": 3 })));
    let mut states = Vec::new();
    for i in 0..4 {
        states.push(env.job(&format!("later-{i}")).await.state);
    }
    assert_eq!(
        states,
        [
            JobState::Cancelled,
            JobState::Cancelled,
            JobState::Cancelled,
            JobState::Received
        ],
        "the oldest three"
    );
    let (_, body) = post_action(&url, json!({ "state": "received" })).await;
    assert_eq!(body, json!({ "cancelled": 1 }));
    let (_, body) = post_action(&url, json!({})).await;
    assert_eq!(body, json!({ "cancelled": 0 }), "nothing live is left");
    assert_eq!(
        env.job("done").await.state,
        JobState::Acked,
        "a finished job is never touched"
    );
    let later = env.job("later-0").await;
    assert!(later.history.iter().any(|h| h.state == JobState::Cancelled));
    assert_eq!(
        env.provider.requests().len(),
        1,
        "no cancelled job called the model"
    );
}

/// Re-run: `POST /v1/jobs/{id}/rerun {"id": new}` makes a new job with the
/// same workflow, input and webhook under the new id, idempotent by it; the
/// original is untouched.
#[actix_rt::test]
async fn a_finished_job_is_rerun_under_a_new_id_once() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    env.submit("first", "hello").await;
    env.submit("other", "something else").await;
    for id in ["first", "other"] {
        env.wait_for(id, JobState::Acked, Duration::from_secs(20))
            .await;
    }
    let rerun = |id: &str| format!("{base}/v1/jobs/{id}/rerun");
    let (status, created) = post_action(&rerun("first"), json!({ "id": "again" })).await;
    assert_eq!(status, 201, "{created}");
    let again = env
        .wait_for("again", JobState::Acked, Duration::from_secs(20))
        .await;
    let first = env.job("first").await;
    assert_eq!(
        (again.workflow.as_str(), &again.input),
        (first.workflow.as_str(), &first.input)
    );
    assert_eq!(again.webhook_url, first.webhook_url);
    assert_eq!(env.provider.requests_for("job:again:generate"), 1);
    assert_eq!(env.consumer.processed_for("again"), 1);
    let (status, _) = post_action(&rerun("first"), json!({ "id": "again" })).await;
    assert_eq!(status, 200, "the same rerun again");
    let (status, body) = post_action(&rerun("other"), json!({ "id": "again" })).await;
    assert_eq!(status, 409, "{body}");
    let (status, _) = post_action(&rerun("nobody"), json!({ "id": "x" })).await;
    assert_eq!(status, 404);
    for bad in [
        json!({ "id": "a b" }),
        json!({}),
        json!({ "id": "x", "more": 1 }),
    ] {
        let (status, body) = post_action(&rerun("first"), bad.clone()).await;
        assert_eq!(status, 422, "{bad}: {body}");
    }
    assert_eq!(
        env.provider.requests_for("job:again:generate"),
        1,
        "one new job"
    );
    assert_eq!(
        env.job("first").await.attempts,
        first.attempts,
        "the original untouched"
    );
    let (status, body) = get_as(&format!("{base}/v1/jobs?surprise=1"), None).await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("surprise")),
        "an unknown list parameter: {body}"
    );
}

/// Runs the real binary with `args` (off the runtime), returning whether it
/// succeeded and what it printed.
async fn cli(args: Vec<String>) -> (bool, String) {
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"))
            .args(&args)
            .env_remove("ONCEFLOW_TOKEN")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// The day-one operations from the command line: `submit --tag
/// --concurrency-key`, `batch
/// FILE`, `rerun ID --as NEW`, `cancel --all --tag`-free filters.
#[actix_rt::test]
async fn the_cli_tags_batches_reruns_and_cancels_in_bulk() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let s = |v: &str| v.to_owned();
    let (ok, out) = cli(vec![
        s("submit"),
        s("--id"),
        s("cli-tagged"),
        s("--prompt"),
        s("hi"),
        s("--tag"),
        s("team=a"),
        s("--tag"),
        s("env=prod"),
        s("--concurrency-key"),
        s("conv-9"),
        s("--server"),
        base.clone(),
    ])
    .await;
    assert!(ok, "{out}");
    let tagged = env.job("cli-tagged").await;
    assert_eq!(
        serde_json::to_value(&tagged.tags).unwrap(),
        json!({ "team": "a", "env": "prod" })
    );
    assert_eq!(tagged.concurrency_key.as_deref(), Some("conv-9"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jobs.json");
    let mut later = job("cli-b-1", &env.consumer.url());
    later["delay_ms"] = json!(3_600_000);
    let mut bad = job("cli-b-2", &env.consumer.url());
    bad["workflow"] = json!("nope");
    std::fs::write(&file, serde_json::to_vec(&json!([later, bad])).unwrap()).unwrap();
    let (ok, out) = cli(vec![
        s("batch"),
        file.display().to_string(),
        s("--server"),
        base.clone(),
    ])
    .await;
    assert!(!ok, "one job was refused: {out}");
    assert!(
        out.contains("cli-b-1: 201") && out.contains("cli-b-2: 422 invalid"),
        "{out}"
    );
    let (ok, out) = cli(vec![
        s("rerun"),
        s("cli-tagged"),
        s("--as"),
        s("cli-again"),
        s("--server"),
        base.clone(),
    ])
    .await;
    assert!(ok && out.contains("cli-again created"), "{out}");
    let (ok, out) = cli(vec![
        s("cancel"),
        s("--all"),
        s("--state"),
        s("received"),
        s("--reason"),
        s("tidy"),
        s("--server"),
        base.clone(),
    ])
    .await;
    assert!(ok && out.contains("cancelled: 3"), "{out}");
    assert_eq!(env.job("cli-b-1").await.state, JobState::Cancelled);
}

/// Every operation the served document describes (and the console's page)
/// refuses a query parameter the document does not give it, with `422` naming the parameter, before it
/// acts: a cancel sent `?dry_run=true` cancels nothing. The parameters the
/// document lists are taken.
#[actix_rt::test]
async fn every_operation_refuses_a_query_parameter_it_does_not_take() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    env.submit("q", "hello").await;
    let doc = onceflow_engine::api::openapi::document();
    let mut tried = 0;
    for (pattern, item) in doc["paths"].as_object().unwrap() {
        let path = pattern.replace("{id}", "q").replace("{name}", "go");
        for method in item.as_object().unwrap().keys() {
            let method: reqwest::Method = method.to_uppercase().parse().unwrap();
            let r = client()
                .request(method.clone(), format!("{base}{path}?dry_run=true"))
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            assert_eq!(
                (status, body["error"]["field"].as_str()),
                (422, Some("dry_run")),
                "{method} {path}: {body}"
            );
            tried += 1;
        }
    }
    for path in ["/", "/console.js"] {
        let (status, body) = get_as(&format!("{base}{path}?dry_run=true"), None).await;
        assert_eq!(
            (status, body["error"]["field"].as_str()),
            (422, Some("dry_run")),
            "{path}"
        );
        tried += 1;
    }
    assert!(tried >= 22, "every operation tried ({tried})");
    assert_eq!(
        env.job("q").await.state,
        JobState::Received,
        "not cancelled"
    );
    for url in [
        format!("{base}/v1/jobs?limit=5&state=received"),
        format!("{base}/v1/schedules?limit=5"),
    ] {
        let (status, body) = get_as(&url, None).await;
        assert_eq!(status, 200, "{url}: {body}");
    }
    let (status, _) = post_action(&format!("{base}/v1/jobs/q/cancel"), json!({})).await;
    assert_eq!(status, 202);
    assert_eq!(env.job("q").await.state, JobState::Cancelled);
}

/// The served document and the server take the same parameters and body
/// fields: for every operation, each query parameter and each body field
/// the document names is taken (whatever else the server says of its
/// value, it is not refused as unknown), and a parameter or field the
/// document does not name is refused with `422` naming it. Each body is
/// parsed into the type the document is derived from, so a field added on
/// one side only (a property kept for the document alone, a parameter
/// described by hand) fails here.
#[actix_rt::test]
async fn the_document_names_every_parameter_and_field_the_server_takes() {
    let env = TestEnv::new().await;
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let doc = onceflow_engine::api::openapi::document();
    let schemas = doc["components"]["schemas"].clone();
    let resolve = |schema: &Value| -> Value {
        let mut schema = schema.clone();
        // `Option<Body>` is `oneOf [null, $ref]`.
        if let Some(one) = schema["oneOf"].as_array() {
            if let Some(s) = one.iter().find(|s| s.get("$ref").is_some()) {
                schema = s.clone();
            }
        }
        match schema["$ref"].as_str() {
            Some(r) => schemas[r.trim_start_matches("#/components/schemas/")].clone(),
            None => schema,
        }
    };
    // Refused as unknown: a 422 naming `name` whose message says so.
    let unknown = |status: u16, body: &Value, name: &str| {
        status == 422
            && body["error"]["field"] == name
            && body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("unknown"))
    };
    let send = |method: reqwest::Method, url: String, body: Option<Value>| async move {
        let mut r = client()
            .request(method, url)
            .header("content-type", "application/json");
        if let Some(body) = body {
            r = r.body(body.to_string());
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null))
    };
    let (mut params, mut fields, mut operations) = (0, 0, 0);
    for (pattern, item) in doc["paths"].as_object().unwrap() {
        for (verb, op) in item.as_object().unwrap() {
            let method: reqwest::Method = verb.to_uppercase().parse().unwrap();
            // A fresh job per operation: an action may end the one before.
            operations += 1;
            env.submit(&format!("doc-{operations}"), "hi").await;
            let path = pattern
                .replace("{id}", &format!("doc-{operations}"))
                .replace("{name}", "go");
            let url = format!("{base}{path}");
            let body = op["requestBody"]["content"]["application/json"]["schema"].clone();
            let has_body = !body.is_null();
            let empty = has_body.then(|| json!({}));
            for p in op["parameters"].as_array().into_iter().flatten() {
                if p["in"] != "query" {
                    continue;
                }
                let name = p["name"].as_str().unwrap();
                let (status, answer) =
                    send(method.clone(), format!("{url}?{name}=1"), empty.clone()).await;
                assert!(
                    !unknown(status, &answer, name),
                    "{verb} {pattern} ?{name}: {answer}"
                );
                params += 1;
            }
            let (status, answer) = send(
                method.clone(),
                format!("{url}?zz_undocumented=1"),
                empty.clone(),
            )
            .await;
            assert!(
                unknown(status, &answer, "zz_undocumented"),
                "{verb} {pattern}: {answer}"
            );
            if !has_body {
                continue;
            }
            let schema = resolve(&body);
            let properties = schema["properties"].as_object().expect("a body of fields");
            for name in properties.keys() {
                let (status, answer) =
                    send(method.clone(), url.clone(), Some(json!({ name: null }))).await;
                assert!(
                    !unknown(status, &answer, name),
                    "{verb} {pattern} .{name}: {answer}"
                );
                fields += 1;
            }
            let (status, answer) = send(
                method.clone(),
                url.clone(),
                Some(json!({ "zz_undocumented": 1 })),
            )
            .await;
            assert!(
                unknown(status, &answer, "zz_undocumented"),
                "{verb} {pattern} body: {answer}"
            );
        }
    }
    // list (7), two redrives (1 each), schedules (2); submit (9), batch (1),
    // signal (3), cancel, redrive (1 each), bulk cancel (5), bulk redrive
    // (3), rerun (1), a schedule (7).
    assert_eq!(
        (operations, params, fields),
        (21, 11, 31),
        "every operation, parameter and field tried"
    );
}

/// A cancel that lands while the completion webhook is on the wire waits
/// for the send's outcome: the consumer holds each POST for a second, a
/// cancel (one, then a bulk cancel by tag of three more) is sent as soon as
/// the job's webhook is in flight. Each job ends `acked` with its delivery
/// `delivered`, as the consumer saw it (one request each); the single
/// cancel answers `409`, the bulk one counts none. (Before: `202`, the
/// jobs `cancelled` with a dead delivery the consumer had received.)
#[actix_rt::test]
async fn a_cancel_meeting_a_webhook_on_the_wire_waits_for_its_outcome() {
    use onceflow_engine::testkit::Behaviour;
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let _engine = env.start(
        engine_registry(onceflow_engine::DeliveryPolicy::AtLeastOnce),
        env.config(),
    );
    let base = list_api(&env, onceflow_engine::api::Auth::Off);
    let in_flight = |id: &'static str| {
        let env = &env;
        async move {
            wait_until(Duration::from_secs(20), || async {
                env.sql(&format!(
                    "SELECT count(*) AS n FROM outbox WHERE job_id = '{id}' \
                     AND status = 'claimed' AND in_flight_until > clock_timestamp()"
                ))
                .await[0]["n"]
                    == json!(1)
            })
            .await
        }
    };
    env.consumer
        .push_for("on-wire", Behaviour::Slow(Duration::from_secs(1)));
    env.submit("on-wire", "hello").await;
    assert!(in_flight("on-wire").await, "the webhook is on the wire");
    let (status, body) = post_action(
        &format!("{base}/v1/jobs/on-wire/cancel"),
        json!({ "reason": "too late" }),
    )
    .await;
    assert_eq!(status, 409, "it finished while the cancel waited: {body}");
    let job = env.job("on-wire").await;
    assert_eq!(job.state, JobState::Acked);
    assert_eq!(job.delivery.unwrap().status, "delivered");
    assert_eq!(env.consumer.processed_for("on-wire"), 1);

    let ids = ["bulk-a", "bulk-b", "bulk-c"];
    for id in ids {
        env.consumer
            .push_for(id, Behaviour::Slow(Duration::from_secs(1)));
        let (status, _) = post_job(
            &base,
            &json!({
                "id": id, "workflow": "completion", "webhook_url": env.consumer.url(),
                "tags": { "batch": "b" },
                "input": { "model": "m", "messages": [{ "role": "user", "content": id }] },
            }),
        )
        .await;
        assert_eq!(status, 201);
    }
    for id in ids {
        assert!(in_flight(id).await, "{id}'s webhook is on the wire");
    }
    let (status, answer) = post_action(
        &format!("{base}/v1/jobs/cancel"),
        json!({ "reason": "too late", "tag": "batch:b" }),
    )
    .await;
    assert_eq!((status, &answer["cancelled"]), (202, &json!(0)), "{answer}");
    for id in ids {
        let job = env.job(id).await;
        assert_eq!(job.state, JobState::Acked, "{id}");
        assert_eq!(job.delivery.unwrap().status, "delivered", "{id}");
        assert_eq!(env.consumer.processed_for(id), 1, "{id}");
        assert_eq!(
            env.consumer.deliveries_for(id).len(),
            1,
            "{id}: one request"
        );
    }
}
