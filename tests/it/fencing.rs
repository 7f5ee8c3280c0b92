//! No effect after a cancel or a takeover, without any crash: a model call
//! parked on a provider limit, a general step, a failure event sent by a
//! slow batch, and the heartbeat under a saturated pool. Each test counts
//! what the provider, the consumer or the step's work saw.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::node::actor::Outcome;
use onceflow_engine::rules::quota::Limits;
use onceflow_engine::testkit::{wait_until, Behaviour, TestEnv};
use onceflow_engine::{Context, Db, EngineConfig, Registry, StepError, Store, Workflow};
use onceflow_workflows::Completion;
use serde_json::{json, Value};

fn completion() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

/// One call at a time for the test model, and a lease long enough that no
/// heartbeat or lease expiry happens during the test.
fn limited(env: &TestEnv) -> EngineConfig {
    let mut config = env.config();
    config.limits = Limits::parse(r#"{"test-model": {"concurrency": 1}}"#).unwrap();
    config.lease = Duration::from_secs(60);
    config.provider.timeout = Duration::from_secs(20);
    config
}

async fn count(env: &TestEnv, sql: &str) -> i64 {
    env.sql(sql).await[0]["n"].as_i64().unwrap()
}

/// Whether job `id` waits for a provider slot: parked (released with
/// `waiting: {"kind": "provider"}`), or its call queued in place.
async fn waiting(env: &TestEnv, id: &str) -> i64 {
    count(
        env,
        &format!(
            "SELECT (SELECT count(*) FROM provider_waiters WHERE holder LIKE 'job:{id}:%') \
                 + (SELECT count(*) FROM jobs WHERE id = '{id}' AND finished_at IS NULL \
                    AND lease_owner IS NULL AND waiting->>'kind' = 'provider') AS n"
        ),
    )
    .await
}

/// A call that finds its provider limit's only slot held parks its job,
/// under its fence, and sends nothing: the attempt ends `waiting` at once
/// (it holds no lease while it waits), its journaled call is no longer
/// marked in flight, and the job is due again when the slot frees. Its job
/// taken over meanwhile (the epoch moved on, as a takeover or a cancel
/// moves it), the old attempt has nothing left to send.
#[actix_rt::test]
async fn a_parked_model_call_of_a_taken_over_job_is_never_sent() {
    let env = TestEnv::new().await;
    // Long enough that the second call is surely parked before it ends.
    env.provider.set_latency(Duration::from_secs(4));
    let registry = completion();
    env.submit("park-hold", "hi").await;
    let hold = env.lease("node-a", Duration::from_secs(60)).await;
    env.submit("park-taken", "hi").await;
    let parked = env.lease("node-a", Duration::from_secs(60)).await;
    assert_eq!(parked.fence.job_id, "park-taken");
    let (r1, c1) = (registry.clone(), limited(&env));
    let env = Arc::new(env);
    let e1 = env.clone();
    let holding = actix_rt::spawn(async move { e1.run_attempt(&r1, hold, c1).await });
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.provider.requests_for("job:park-hold:generate") == 1
        })
        .await
    );
    let (r2, c2, e2) = (registry.clone(), limited(&env), env.clone());
    let parking = actix_rt::spawn(async move { e2.run_attempt(&r2, parked, c2).await });
    assert!(
        wait_until(Duration::from_secs(10), || async {
            waiting(&env, "park-taken").await == 1
        })
        .await,
        "the second call waits for the only slot"
    );
    let outcome = tokio::time::timeout(Duration::from_secs(10), parking)
        .await
        .expect("the parked attempt ends at once")
        .unwrap();
    assert!(matches!(outcome, Outcome::Waiting { .. }), "{outcome:?}");
    let mark = env
        .sql(
            "SELECT in_flight_until IS NULL AS unmarked, attempts FROM model_calls \
              WHERE idempotency_key = 'job:park-taken:generate'",
        )
        .await[0]
        .clone();
    assert_eq!(
        mark,
        json!({ "unmarked": true, "attempts": 0 }),
        "never sent"
    );
    // A takeover, seen by no heartbeat (these attempts have none).
    env.execute("UPDATE jobs SET lease_epoch = lease_epoch + 1 WHERE id = 'park-taken'")
        .await;
    assert_eq!(holding.await.unwrap(), Outcome::Acked);
    assert_eq!(
        count(
            &env,
            "SELECT count(*) AS n FROM jobs WHERE id = 'park-taken' AND run_at <= now()"
        )
        .await,
        1,
        "the freed slot made the parked job due"
    );
    assert_eq!(
        env.provider.requests_for("job:park-taken:generate"),
        0,
        "the old attempt's call was never sent"
    );
}

/// A cancel reaches a job parked behind a provider limit at once: it holds
/// no attempt, so the cancel ends it long before the slot would have come
/// free, and it never sends.
#[actix_rt::test]
async fn a_cancel_wakes_a_parked_model_call_at_once() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(6));
    let _node = env.start(completion(), limited(&env));
    env.submit("wake-hold", "hi").await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.provider.requests_for("job:wake-hold:generate") == 1
        })
        .await
    );
    env.submit("wake-parked", "hi").await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            waiting(&env, "wake-parked").await == 1
        })
        .await
    );
    let cancelled_at = std::time::Instant::now();
    env.store
        .jobs()
        .cancel("wake-parked", "test", "no longer wanted")
        .await
        .unwrap();
    // The held call answers 6 s after it was sent; the cancel must not wait for it.
    let left = wait_until(Duration::from_secs(3), || async {
        waiting(&env, "wake-parked").await == 0
    })
    .await;
    assert!(
        left,
        "the parked call still waited {:?} after the cancel",
        cancelled_at.elapsed()
    );
    assert_eq!(
        env.job("wake-hold").await.state,
        onceflow_engine::JobState::Received,
        "the parked call left while the slot was still held, not when it came free"
    );
    env.wait_for(
        "wake-hold",
        onceflow_engine::JobState::Acked,
        Duration::from_secs(20),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.provider.requests_for("job:wake-parked:generate"), 0);
    assert_eq!(env.consumer.deliveries_for("wake-parked").len(), 0);
}

/// A workflow whose body waits at a gate the test opens, then runs one
/// general step that counts its runs.
#[derive(Clone)]
struct Gated {
    reached: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Notify>,
    runs: Arc<AtomicU32>,
}

impl Workflow for Gated {
    const NAME: &'static str = "test.gated";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _input: Value) -> Result<Value, StepError> {
        self.reached.notify_one();
        self.gate.notified().await;
        let runs = self.runs.clone();
        let n: u32 = ctx
            .step("effect", |_| async move {
                Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
            })
            .await?;
        Ok(json!({ "runs": n }))
    }
}

/// `ctx.step` begins with a fenced read: an attempt whose job was taken
/// over (or cancelled) while its body ran does not run the step's work.
#[actix_rt::test]
async fn a_step_of_a_taken_over_attempt_does_not_run() {
    let env = TestEnv::new().await;
    let gated = Gated {
        reached: Default::default(),
        gate: Default::default(),
        runs: Default::default(),
    };
    let mut registry = Registry::new();
    registry.register(gated.clone());
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: "step-zombie".into(),
        workflow: "test.gated".into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let config = env.config();
    let env = Arc::new(env);
    let e = env.clone();
    let attempt = actix_rt::spawn(async move { e.run_attempt(&registry, leased, config).await });
    gated.reached.notified().await;
    env.execute("UPDATE jobs SET lease_epoch = lease_epoch + 1 WHERE id = 'step-zombie'")
        .await;
    gated.gate.notify_one();
    assert_eq!(attempt.await.unwrap(), Outcome::LeaseLost);
    assert_eq!(
        gated.runs.load(Ordering::SeqCst),
        0,
        "the fenced-out attempt ran the step's work"
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(*) AS n FROM steps WHERE job_id = 'step-zombie'"
        )
        .await,
        0
    );
}

/// Dead jobs with failure events and no engine yet: their `job.dead` rows
/// are due at once.
async fn dead_with_events(env: &TestEnv, prefix: &str, n: usize) {
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        env.submit(&id, "hi").await;
        env.execute(&format!(
            "WITH d AS (UPDATE jobs SET state = 'dead', dead_reason = 'test', finished_at = now() \
                 WHERE id = '{id}' RETURNING id, request) \
             INSERT INTO outbox (job_id, event, idempotency_key, url, body) \
             SELECT id, 'job.dead', 'job:' || id || ':dead', request->>'webhook_url', \
                 jsonb_build_object('type', 'job.dead', 'timestamp', now(), \
                     'data', jsonb_build_object('job_id', id)) FROM d"
        ))
        .await;
    }
}

/// A claimed batch of failure events is not claimed again while it is
/// marked in flight.
#[actix_rt::test]
async fn claimed_failure_events_are_not_claimed_twice() {
    let env = TestEnv::new().await;
    dead_with_events(&env, "claim", 3).await;
    let first = env.store.events().claim(32, 60_000).await.unwrap();
    assert_eq!(first.len(), 3);
    let second = env.store.events().claim(32, 60_000).await.unwrap();
    assert_eq!(
        second.len(),
        0,
        "in flight: another node must not send them"
    );
}

/// A late outcome from a node whose claim lapsed (A) is not recorded over
/// the claim that took the event since (B): B's in-flight mark stays, so a
/// third node does not send while B's request is still open.
#[actix_rt::test]
async fn a_late_event_outcome_does_not_clear_a_newer_claim() {
    let env = TestEnv::new().await;
    dead_with_events(&env, "late", 1).await;
    let a = env.store.events().claim(32, 1).await.unwrap();
    assert_eq!(a.len(), 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = env.store.events().claim(32, 60_000).await.unwrap();
    assert_eq!(b.len(), 1, "A's mark lapsed: B claims the event");
    assert!(env
        .store
        .events()
        .mark_sending(&b[0], 60_000)
        .await
        .unwrap());
    // A's send failed; its "retry now" arrives after B's claim.
    let envelope = onceflow_engine::ErrorEnvelope {
        code: "http_503".into(),
        message: "503".into(),
        retryable: true,
    };
    env.store
        .events()
        .outcome(
            &a[0].idempotency_key,
            a[0].attempts,
            Some(503),
            Some(&envelope),
            Some(Duration::ZERO),
        )
        .await
        .unwrap();
    let c = env.store.events().claim(32, 60_000).await.unwrap();
    assert_eq!(c.len(), 0, "B's send is still in flight: C must not send");
    // B's own outcome is recorded.
    env.store
        .events()
        .outcome(&b[0].idempotency_key, b[0].attempts, Some(200), None, None)
        .await
        .unwrap();
    assert_eq!(
        env.sql("SELECT status::text AS s FROM outbox WHERE idempotency_key = 'job:late-0:dead'")
            .await[0]["s"],
        "delivered"
    );
}

/// Two nodes, one slow consumer: node A claims ten events at once and sends
/// them one by one, each taking a second, past the claim's single in-flight
/// mark (webhook timeout + 5 s = 7 s). Each event's own send is marked, so
/// node B never sends one A is about to: one POST per event.
#[actix_rt::test]
async fn failure_events_are_posted_once_across_nodes_with_a_slow_consumer() {
    let env = TestEnv::new().await;
    let n = 10;
    dead_with_events(&env, "slow-ev", n).await;
    for i in 0..n {
        env.consumer.push_for(
            &format!("slow-ev-{i}"),
            Behaviour::Slow(Duration::from_secs(1)),
        );
    }
    let node = |name: &str| {
        let mut config = env.config();
        config.node_id = name.into();
        config.webhook_timeout = Duration::from_secs(2);
        config
    };
    let _a = env.start(completion(), node("events-a"));
    assert!(
        wait_until(Duration::from_secs(10), || async {
            count(
                &env,
                "SELECT count(*) AS n FROM outbox WHERE event = 'job.dead' AND attempts = 1",
            )
            .await
                == n as i64
        })
        .await,
        "node A claimed every event in one batch"
    );
    let _b = env.start(completion(), node("events-b"));
    let all = wait_until(Duration::from_secs(40), || async {
        count(
            &env,
            "SELECT count(*) AS n FROM outbox WHERE event = 'job.dead' AND status = 'delivered'",
        )
        .await
            == n as i64
    })
    .await;
    assert!(all, "every event delivered");
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..n {
        let key = format!("job:slow-ev-{i}:dead");
        assert_eq!(env.consumer.requests_with_key(&key), 1, "{key}");
    }
}

/// Lease renewals and token lookups have connections of their own: with
/// every connection of the main pool held, both still answer.
#[actix_rt::test]
async fn heartbeats_and_token_lookups_do_not_queue_behind_a_saturated_pool() {
    let env = TestEnv::new().await;
    env.submit("saturated", "hi").await;
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let db = Db::connect(&env.db_url, 2).await.unwrap();
    let store = Store::new(db.clone());
    let _held = (db.conn().await.unwrap(), db.conn().await.unwrap());
    let renewal = tokio::time::timeout(
        Duration::from_secs(5),
        store.leases().renew(
            "node-a",
            &[("saturated".into(), leased.fence.epoch)],
            60_000,
        ),
    )
    .await
    .expect("the renewal did not wait for the saturated pool")
    .unwrap();
    assert_eq!(renewal.renewed, 1);
    assert!(renewal.lost.is_empty());
    let looked_up =
        tokio::time::timeout(Duration::from_secs(5), store.tokens().authenticate("bogus"))
            .await
            .expect("the token lookup did not wait for the saturated pool")
            .unwrap();
    assert!(looked_up.is_none());
}

/// A zombie's stream chunks are not journaled: the chunk insert is fenced
/// by the epoch.
#[actix_rt::test]
async fn a_zombie_writes_no_stream_chunks() {
    let env = TestEnv::new().await;
    env.submit("stream-zombie", "hi").await;
    let old = env.lease("node-a", Duration::from_secs(60)).await.fence;
    env.execute("UPDATE jobs SET lease_epoch = lease_epoch + 1 WHERE id = 'stream-zombie'")
        .await;
    let written = env
        .store
        .journal()
        .stream(
            &old,
            "job:stream-zombie:generate",
            1,
            vec![onceflow_engine::store::streams::StreamRow {
                offset: 0,
                kind: "chunk",
                text: "zombie".into(),
            }],
        )
        .await
        .unwrap();
    assert_ne!(written.0, onceflow_engine::store::Checkpoint::Moved);
    assert_eq!(
        count(
            &env,
            "SELECT count(*) AS n FROM stream_events WHERE job_id = 'stream-zombie'"
        )
        .await,
        0
    );
}
