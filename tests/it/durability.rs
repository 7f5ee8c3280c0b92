//! The durable job: each test names a guarantee and counts what the fake
//! provider and consumer processed.

use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::actor::Outcome;
use onceflow_engine::testkit::{wait_until, Behaviour, TestEnv};
use onceflow_engine::{DeliveryPolicy, JobState, Registry};
use onceflow_workflows::Completion;

const WAIT: Duration = Duration::from_secs(20);

fn gen_key(id: &str) -> String {
    format!("job:{id}:generate")
}

fn hook_key(id: &str) -> String {
    format!("job:{id}:completed")
}

fn registry(delivery: DeliveryPolicy) -> Registry {
    let mut r = Registry::new();
    r.register(Completion::with_delivery(delivery));
    r
}

/// How many history rows of `id` are in `state`.
async fn history_count(env: &TestEnv, id: &str, state: JobState) -> usize {
    env.job(id)
        .await
        .history
        .iter()
        .filter(|h| h.state == state)
        .count()
}

/// Every lifecycle state appears once, in order (no state skipped or repeated).
async fn assert_clean_history(env: &TestEnv, id: &str) {
    let states: Vec<JobState> = env.job(id).await.history.iter().map(|h| h.state).collect();
    assert_eq!(states, JobState::ALL[..6].to_vec(), "history of {id}");
}

/// Exactly one processed delivery for `id`, every request keyed `job:{id}:completed`.
fn assert_one_delivery(env: &TestEnv, id: &str) {
    let deliveries = env.consumer.deliveries_for(id);
    assert!(!deliveries.is_empty(), "no delivery for {id}");
    for d in &deliveries {
        assert_eq!(d.idempotency_key.as_deref(), Some(hook_key(id).as_str()));
        assert_eq!(d.webhook_id.as_deref(), Some(hook_key(id).as_str()));
        assert_eq!(d.body["type"], "job.completed");
        assert_eq!(d.body["data"]["job_id"], id);
    }
    assert_eq!(env.consumer.processed_for(id), 1, "{deliveries:#?}");
}

#[actix_rt::test]
async fn a_clean_job_runs_the_six_states_once() {
    let env = TestEnv::new().await;
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("clean-1", "hello").await;
    let job = env.wait_for("clean-1", JobState::Acked, WAIT).await;
    assert_clean_history(&env, "clean-1").await;
    assert_eq!(job.result.as_ref().unwrap()["content"], "echo: hello (#1)");
    assert_eq!(env.provider.requests_for(&gen_key("clean-1")), 1);
    assert_eq!(env.consumer.deliveries_for("clean-1").len(), 1);
    assert_one_delivery(&env, "clean-1");
    let delivery = job.delivery.unwrap();
    assert_eq!(delivery.status, "delivered");
    assert_eq!(delivery.idempotency_key, hook_key("clean-1"));
    let usage = env
        .sql("SELECT input_tokens, output_tokens FROM model_calls WHERE job_id = 'clean-1'")
        .await;
    assert_eq!(usage[0]["input_tokens"], 7);
    assert_eq!(usage[0]["output_tokens"], 3);
    assert_eq!(env.provider.requests()[0].http_version, "HTTP/1.1");
}

#[actix_rt::test]
async fn model_calls_go_over_http2_with_h2c() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.provider.h2c = true;
    env.provider.set_latency(Duration::from_millis(300));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    let ids: Vec<String> = (0..5).map(|i| format!("h2c-{i}")).collect();
    for id in &ids {
        env.submit(id, "hello").await;
    }
    for id in &ids {
        env.wait_for(id, JobState::Acked, WAIT).await;
        assert_eq!(env.provider.requests_for(&gen_key(id)), 1);
        assert_one_delivery(&env, id);
    }
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 5);
    assert!(
        requests.iter().all(|r| r.http_version == "HTTP/2.0"),
        "{:?}",
        requests.iter().map(|r| &r.http_version).collect::<Vec<_>>()
    );
}

#[actix_rt::test]
async fn the_delivery_and_the_ack_share_one_commit_so_a_crash_after_it_redoes_nothing() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("ack-1", FailPoint::AfterCommit("delivered"), Action::Crash);
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("ack-1", "hello").await;
    env.wait_for("ack-1", JobState::Acked, WAIT).await;
    let fired = wait_until(WAIT, || async { env.faults.fired("ack-1") }).await;
    assert!(fired, "the crash point was reached");
    let job = env.job("ack-1").await;
    assert_eq!(job.attempts, 1, "acked by the commit before the crash");
    assert_eq!(env.consumer.deliveries_for("ack-1").len(), 1);
    assert_one_delivery(&env, "ack-1");
    assert_clean_history(&env, "ack-1").await;
    let held = env
        .sql("SELECT id FROM jobs WHERE finished_at IS NULL OR lease_owner IS NOT NULL")
        .await;
    assert_eq!(held.as_array().unwrap().len(), 0, "{held}");
}

/// A job at `delivered` (a row written by a version that committed the
/// delivery and the ack apart) is acked without delivering again, even when
/// its first ack fails.
#[actix_rt::test]
async fn a_job_found_at_delivered_is_acked_without_delivering_again() {
    let env = TestEnv::new().await;
    let registry = registry(DeliveryPolicy::AtLeastOnce);
    env.submit("ack-2", "hello").await;
    // An attempt that sends the webhook and dies before recording it...
    env.faults
        .arm_once("ack-2", FailPoint::BeforeCommit("delivered"), Action::Crash);
    let leased = env.lease("old-node", Duration::from_secs(60)).await;
    env.run_attempt(&registry, leased, env.config()).await;
    assert!(env.faults.fired("ack-2"));
    assert_eq!(env.consumer.deliveries_for("ack-2").len(), 1);
    // ...and the delivery recorded alone, as the older version did; its lease lapsed.
    env.execute(
        "WITH j AS (UPDATE jobs SET state = 'delivered', \
             lease_expires_at = now() - interval '1 second' WHERE id = 'ack-2' RETURNING id), \
         o AS (UPDATE outbox SET status = 'delivered', delivered_at = now(), in_flight_until = NULL \
             WHERE job_id = 'ack-2') \
         INSERT INTO job_history (job_id, state, attempt, worker) \
         SELECT id, 'delivered', 1, 'old-node' FROM j",
    )
    .await;
    env.faults.arm_once("ack-2", FailPoint::Ack, Action::Fail);
    env.faults.record();
    let _engine = env.start(registry, env.config());
    let job = env.wait_for("ack-2", JobState::Acked, WAIT).await;
    assert!(job.attempts >= 3, "the failed ack forced another attempt");
    assert_eq!(
        env.faults
            .hits()
            .iter()
            .filter(|(id, p)| id == "ack-2" && *p == FailPoint::Ack)
            .count(),
        2,
        "the ack step ran twice (failed, then acked)"
    );
    assert_eq!(
        env.consumer.deliveries_for("ack-2").len(),
        1,
        "never sent again"
    );
    assert_eq!(env.provider.requests_for(&gen_key("ack-2")), 1);
    assert_eq!(history_count(&env, "ack-2", JobState::Acked).await, 1);
    assert_clean_history(&env, "ack-2").await;
}

#[actix_rt::test]
async fn a_crash_between_claim_and_delivery_is_delivered_by_recovery() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("claim-1", FailPoint::AfterCommit("claimed"), Action::Crash);
    let engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("claim-1", "hello").await;
    env.wait_for("claim-1", JobState::Acked, WAIT).await;
    assert_eq!(env.consumer.deliveries_for("claim-1").len(), 1);
    assert_one_delivery(&env, "claim-1");
    assert_eq!(env.provider.requests_for(&gen_key("claim-1")), 1);
    assert!(
        engine
            .counters()
            .takeovers
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert_clean_history(&env, "claim-1").await;
}

#[actix_rt::test]
async fn a_crash_mid_request_resends_with_the_same_key_at_least_once() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("mid-1", FailPoint::WebhookAfterSend, Action::Crash);
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("mid-1", "hello").await;
    env.wait_for("mid-1", JobState::Acked, WAIT).await;
    let deliveries = env.consumer.deliveries_for("mid-1");
    assert_eq!(
        deliveries.len(),
        2,
        "the crashed send is repeated once: {deliveries:#?}"
    );
    assert!(
        deliveries[1].duplicate,
        "the consumer sees the repeat as a duplicate"
    );
    assert_one_delivery(&env, "mid-1");
    assert_clean_history(&env, "mid-1").await;
}

#[actix_rt::test]
async fn at_most_once_surfaces_an_unrecorded_send_as_unknown_and_never_resends() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("amo-1", FailPoint::WebhookAfterSend, Action::Crash);
    let _engine = env.start(registry(DeliveryPolicy::AtMostOnce), env.config());
    env.submit("amo-1", "hello").await;
    let job = env.wait_for("amo-1", JobState::Dead, WAIT).await;
    assert_eq!(
        env.consumer.deliveries_for("amo-1").len(),
        1,
        "never sent again"
    );
    let delivery = job.delivery.expect("outbox row");
    assert_eq!(delivery.status, "unknown");
    assert!(job.dead_reason.unwrap().contains("unknown"));
    // Give the supervisor time to (wrongly) try again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.consumer.deliveries_for("amo-1").len(), 1);
}

#[actix_rt::test]
async fn at_most_once_sends_a_claim_that_crashed_before_any_send() {
    let env = TestEnv::new().await;
    env.faults
        .arm_once("amo-2", FailPoint::AfterCommit("claimed"), Action::Crash);
    let _engine = env.start(registry(DeliveryPolicy::AtMostOnce), env.config());
    env.submit("amo-2", "hello").await;
    let job = env.wait_for("amo-2", JobState::Acked, WAIT).await;
    assert!(
        env.faults
            .fired_at("amo-2", FailPoint::AfterCommit("claimed")),
        "the crash after the claim fired"
    );
    assert!(
        job.attempts >= 2,
        "a second attempt sent it: {}",
        job.attempts
    );
    assert_eq!(env.consumer.deliveries_for("amo-2").len(), 1);
    assert_one_delivery(&env, "amo-2");
}

#[actix_rt::test]
async fn two_attempts_at_once_with_the_lease_bypassed_deliver_once() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    env.submit("twin-1", "hello").await;
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let reg = registry(DeliveryPolicy::AtLeastOnce);
    let (a, b) = tokio::join!(
        env.run_attempt(&reg, leased.clone(), env.config()),
        env.run_attempt(&reg, leased, env.config()),
    );
    assert!(
        matches!(a, Outcome::Acked) && matches!(b, Outcome::Acked),
        "{a:?} {b:?}: {:#?}",
        env.job("twin-1").await
    );
    assert_eq!(
        env.provider.requests_for(&gen_key("twin-1")),
        1,
        "at most one model call"
    );
    assert_eq!(
        env.consumer.deliveries_for("twin-1").len(),
        1,
        "one delivery"
    );
    assert_one_delivery(&env, "twin-1");
    assert_clean_history(&env, "twin-1").await;
}

#[actix_rt::test]
async fn a_second_attempt_during_a_slow_result_write_does_not_call_the_model() {
    let env = TestEnv::new().await;
    env.submit("slow-1", "hello").await;
    env.faults.arm_once(
        "slow-1",
        FailPoint::BeforeCommit("model_call"),
        Action::Stall(Duration::from_millis(1500)),
    );
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let reg = registry(DeliveryPolicy::AtLeastOnce);
    let first = env.run_attempt(&reg, leased.clone(), env.config());
    let second = async {
        // Start once the first attempt has its answer and is stalled
        // writing it: the answer is not journaled yet.
        assert!(
            wait_until(WAIT, || async {
                env.faults
                    .fired_at("slow-1", FailPoint::BeforeCommit("model_call"))
            })
            .await,
            "the stall before the answer's commit fired"
        );
        assert_eq!(env.provider.requests_for(&gen_key("slow-1")), 1);
        assert_eq!(
            env.sql("SELECT status::text FROM model_calls WHERE job_id = 'slow-1'")
                .await,
            serde_json::json!([{ "status": "pending" }]),
            "the second attempt starts while the answer is unwritten"
        );
        env.run_attempt(&reg, leased.clone(), env.config()).await
    };
    let (a, b) = tokio::join!(first, second);
    assert!(
        matches!(a, Outcome::Acked) && matches!(b, Outcome::Acked),
        "{a:?} {b:?}"
    );
    assert_eq!(env.provider.requests_for(&gen_key("slow-1")), 1);
    assert_one_delivery(&env, "slow-1");
}

#[actix_rt::test]
async fn a_lost_provider_response_is_retried_with_the_same_key() {
    let env = TestEnv::new().await;
    env.provider
        .push(Behaviour::LoseResponse(Duration::from_secs(4)));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("lost-1", "hello").await;
    env.wait_for("lost-1", JobState::Acked, WAIT).await;
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 2, "the lost response forces one retry");
    for r in &requests {
        assert_eq!(
            r.idempotency_key.as_deref(),
            Some(gen_key("lost-1").as_str())
        );
    }
    assert_eq!(
        env.provider.work_done(&gen_key("lost-1")),
        1,
        "the provider did the work once"
    );
    assert_one_delivery(&env, "lost-1");
}

#[actix_rt::test]
async fn the_same_model_key_with_a_different_request_fails_loudly_and_sends_nothing() {
    let env = TestEnv::new().await;
    env.submit("conflict-1", "hello").await;
    // An earlier attempt journaled this key for another request.
    env.execute(
        "INSERT INTO model_calls (job_id, idempotency_key, request_hash) \
         VALUES ('conflict-1', 'job:conflict-1:generate', repeat('0', 64))",
    )
    .await;
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    let job = env.wait_for("conflict-1", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "model_key_conflict");
    assert!(job.dead_reason.unwrap().contains("job:conflict-1:generate"));
    assert!(env.provider.requests().is_empty(), "nothing was sent");
    assert!(env.consumer.deliveries().is_empty());
}

#[actix_rt::test]
async fn a_model_call_longer_than_the_lease_keeps_the_job() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(2500));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(10);
    let engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    env.submit("long-1", "hello").await;
    let job = env.wait_for("long-1", JobState::Acked, WAIT).await;
    assert_eq!(env.provider.requests_for(&gen_key("long-1")), 1, "one call");
    assert_one_delivery(&env, "long-1");
    assert_eq!(job.attempts, 1, "no second attempt");
    assert_eq!(
        engine
            .counters()
            .takeovers
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The lease was kept by renewing it, not only because the node never
    // takes its own running job again: a broken heartbeat shows here.
    assert!(
        engine
            .counters()
            .renewed_leases
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2,
        "the heartbeat renewed the lease during the 2.5 s call"
    );
}

/// The heartbeat's answer names only leases another attempt took: a job its
/// own attempt acked while the heartbeat was on its way keeps its epoch and
/// is not "lost" (under load that raced, logging a takeover that never
/// happened and counting it), while a taken-over job and a vanished row are.
#[actix_rt::test]
async fn renewal_calls_lost_only_what_was_taken_over() {
    let env = TestEnv::new().await;
    let reg = registry(DeliveryPolicy::AtLeastOnce);
    env.submit("renew-done", "hello").await;
    let done = env.lease("node-a", Duration::from_secs(60)).await;
    let done_epoch = done.fence.epoch;
    assert_eq!(
        env.run_attempt(&reg, done, env.config()).await,
        Outcome::Acked
    );
    env.submit("renew-taken", "hello").await;
    let taken = env.lease("node-a", Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let fresh = env.lease("node-b", Duration::from_secs(60)).await;
    assert!(fresh.fence.epoch > taken.fence.epoch, "a takeover");
    env.submit("renew-held", "hello").await;
    let held = env.lease("node-a", Duration::from_millis(500)).await;

    let taken_by_b = env
        .sql("SELECT lease_expires_at::text AS t FROM jobs WHERE id = 'renew-taken'")
        .await;
    let renewal = env
        .store
        .leases()
        .renew(
            "node-a",
            &[
                ("renew-done".into(), done_epoch),
                ("renew-taken".into(), taken.fence.epoch),
                ("renew-held".into(), held.fence.epoch),
                ("renew-missing".into(), 1),
            ],
            60_000,
        )
        .await
        .expect("renew");
    let mut lost = renewal.lost.clone();
    lost.sort();
    assert_eq!(lost, ["renew-missing", "renew-taken"]);
    assert_eq!(renewal.renewed, 1, "only the held lease: {renewal:?}");
    // The held lease was extended (500 ms → a minute); node-b's was not touched.
    assert_eq!(
        env.sql("SELECT lease_expires_at::text AS t FROM jobs WHERE id = 'renew-taken'")
            .await,
        taken_by_b
    );
    let extended = env
        .sql(
            "SELECT id FROM jobs WHERE lease_expires_at > now() + interval '30 seconds' \
             AND lease_owner = 'node-a'",
        )
        .await;
    assert_eq!(extended.as_array().unwrap().len(), 1, "{extended}");
    assert_eq!(extended[0]["id"], "renew-held", "{extended}");
}

#[actix_rt::test]
async fn a_zombie_with_a_stale_epoch_cannot_write_or_call() {
    let env = TestEnv::new().await;
    env.submit("zombie-1", "hello").await;
    let stale = env.lease("node-a", Duration::from_millis(1)).await;
    // The lease expires and another node takes the job over.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _fresh = env.lease("node-b", Duration::from_secs(60)).await;
    let reg = registry(DeliveryPolicy::AtLeastOnce);
    let outcome = env.run_attempt(&reg, stale, env.config()).await;
    assert_eq!(outcome, Outcome::LeaseLost);
    assert!(
        env.provider.requests().is_empty(),
        "the zombie called the model"
    );
    let job = env.job("zombie-1").await;
    assert_eq!(job.state, JobState::Received);
    assert_eq!(job.history.len(), 1);
}

#[actix_rt::test]
async fn a_zombie_cannot_send_the_webhook() {
    let env = TestEnv::new().await;
    env.submit("zombie-2", "hello").await;
    // Run to `claimed`, then crash there.
    env.faults
        .arm_once("zombie-2", FailPoint::AfterCommit("claimed"), Action::Crash);
    let reg = registry(DeliveryPolicy::AtLeastOnce);
    let first = env.lease("node-a", Duration::from_millis(300)).await;
    assert_eq!(
        env.run_attempt(&reg, first, env.config()).await,
        Outcome::Crashed
    );
    // The claim's commit extended the lease to a full lease (1 s).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let stale = env.lease("node-a", Duration::from_millis(1)).await;
    assert_eq!(stale.state, JobState::Claimed);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _fresh = env.lease("node-b", Duration::from_secs(60)).await;
    assert_eq!(
        env.run_attempt(&reg, stale, env.config()).await,
        Outcome::LeaseLost
    );
    assert!(
        env.consumer.deliveries().is_empty(),
        "the zombie sent the webhook"
    );
    assert_eq!(env.job("zombie-2").await.state, JobState::Claimed);
}

#[actix_rt::test]
async fn a_permanent_webhook_refusal_is_dead_with_its_reason() {
    let env = TestEnv::new().await;
    env.consumer.push(Behaviour::Status(410, None));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("gone-1", "hello").await;
    let job = env.wait_for("gone-1", JobState::Dead, WAIT).await;
    assert_eq!(
        env.consumer.deliveries_for("gone-1").len(),
        1,
        "a 4xx is not retried"
    );
    assert_eq!(job.last_error.unwrap().code, "http_410");
    assert_eq!(job.delivery.unwrap().status, "dead");
    assert!(job.result.is_some(), "the result stays");
}

#[actix_rt::test]
async fn retryable_webhook_failures_are_retried_honouring_retry_after() {
    let env = TestEnv::new().await;
    env.consumer.push(Behaviour::Status(503, None));
    env.consumer.push(Behaviour::Status(429, Some(1)));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("retry-1", "hello").await;
    env.wait_for("retry-1", JobState::Acked, WAIT).await;
    let deliveries = env.consumer.deliveries_for("retry-1");
    assert_eq!(deliveries.len(), 3, "{deliveries:#?}");
    // Every resend is the same event: the same body, its timestamp the
    // event's (fixed when it was claimed), not the attempt's.
    assert!(
        deliveries.iter().all(|d| d.body == deliveries[0].body),
        "{deliveries:#?}"
    );
    assert!(deliveries[0].body["timestamp"].is_string());
    assert_one_delivery(&env, "retry-1");
    // Retry-After: 1 is honoured, measured on the consumer's own clock to
    // the millisecond (`webhook-timestamp` has whole seconds only).
    let waited = deliveries[2].received_at - deliveries[1].received_at;
    assert!(
        waited >= Duration::from_millis(1000),
        "the retry after a 429 waited {waited:?}, less than its Retry-After"
    );
}

#[actix_rt::test]
async fn the_webhook_retry_budget_ends_in_dead() {
    let env = TestEnv::new().await;
    for _ in 0..20 {
        env.consumer.push(Behaviour::Status(503, None));
    }
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("hook-budget", "hello").await;
    let job = env.wait_for("hook-budget", JobState::Dead, WAIT).await;
    let budget = env.config().webhook_retry.budget as usize;
    assert_eq!(
        env.consumer.deliveries_for("hook-budget").len(),
        budget,
        "one POST per send of the budget, then none"
    );
    assert_eq!(env.consumer.processed_for("hook-budget"), 0);
    assert!(job.dead_reason.unwrap().contains("budget"));
    let delivery = job.delivery.unwrap();
    assert_eq!(delivery.status, "dead");
    assert_eq!(delivery.attempts as usize, budget);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(env.consumer.deliveries_for("hook-budget").len(), budget);
}

#[actix_rt::test]
async fn a_provider_4xx_is_permanent_and_the_budget_ends_in_dead() {
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), env.config());
    env.submit("bad-1", "hello").await;
    let job = env.wait_for("bad-1", JobState::Dead, WAIT).await;
    assert_eq!(env.provider.requests().len(), 1);
    assert_eq!(job.last_error.unwrap().code, "http_400");

    for _ in 0..10 {
        env.provider.push(Behaviour::Status(500, None));
    }
    env.submit("flaky-1", "hello").await;
    let job = env.wait_for("flaky-1", JobState::Dead, WAIT).await;
    let budget = env.config().model_retry.budget as usize;
    assert_eq!(env.provider.requests_for(&gen_key("flaky-1")), budget);
    assert!(job.dead_reason.unwrap().contains("budget"));
}

#[actix_rt::test]
async fn signed_webhooks_verify() {
    let env = TestEnv::new().await;
    // Two secrets while rotating: one `v1,` signature for each.
    let secret =
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw whsec_KioqKioqKioqKioqKioqKioqKioqKioqKioqKioqKio=";
    let mut config = env.config();
    config.webhook_secret = Some(secret.parse().unwrap());
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    env.submit("signed-1", "hello").await;
    env.wait_for("signed-1", JobState::Acked, WAIT).await;
    let d = &env.consumer.deliveries_for("signed-1")[0];
    let key: onceflow_engine::net::webhook::WebhookSecret = secret.parse().unwrap();
    let ts: i64 = d.timestamp.as_deref().unwrap().parse().unwrap();
    let expected = key.sign(d.webhook_id.as_deref().unwrap(), ts, &d.raw);
    assert_eq!(d.signature.as_deref(), Some(expected.as_str()));
    assert_eq!(expected.matches("v1,").count(), 2, "{expected}");
    for (one, signature) in secret.split(' ').zip(expected.split(' ')) {
        let alone: onceflow_engine::net::webhook::WebhookSecret = one.parse().unwrap();
        assert_eq!(
            alone.sign(d.webhook_id.as_deref().unwrap(), ts, &d.raw),
            signature
        );
    }
}

#[actix_rt::test]
async fn a_graceful_shutdown_hands_running_jobs_over_at_once() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(1500));
    let mut config = env.config();
    config.lease = Duration::from_secs(60); // a crash would leave the job stuck for a minute
                                            // The second node's call waits at the provider for the first one's
                                            // work: a timeout it cannot reach on a loaded machine.
    config.provider.timeout = Duration::from_secs(10);
    let first = env.start(registry(DeliveryPolicy::AtLeastOnce), config.clone());
    env.submit("handover-1", "hello").await;
    assert!(
        wait_until(WAIT, || async {
            env.provider.requests_for(&gen_key("handover-1")) == 1
        })
        .await
    );
    assert_eq!(
        first.shutdown_gracefully().await.unwrap(),
        1,
        "the running job's lease was released"
    );
    config.node_id = "second-node".to_owned();
    let _second = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    let job = env.wait_for("handover-1", JobState::Acked, WAIT).await;
    assert_eq!(job.attempts, 2);
    assert_eq!(
        env.provider.work_done(&gen_key("handover-1")),
        1,
        "the model did the work once"
    );
    assert_eq!(
        env.provider.requests_for(&gen_key("handover-1")),
        2,
        "the abandoned call was asked for again, once, under its key"
    );
    assert_eq!(env.provider.total_work(), 1, "no work under another key");
    assert_one_delivery(&env, "handover-1");
}

#[actix_rt::test]
async fn group_committed_checkpoints_keep_each_rows_guard() {
    use onceflow_engine::store::Checkpoint;
    let env = TestEnv::new().await;
    env.submit("batch-a", "hello").await;
    let a = env.lease("node-a", Duration::from_secs(60)).await;
    env.submit("batch-b", "hello").await;
    let b = env.lease("node-a", Duration::from_secs(60)).await;
    // Both delivered; then b is taken over, so this attempt's fence is stale.
    env.execute("UPDATE jobs SET state = 'delivered' WHERE id IN ('batch-a', 'batch-b')")
        .await;
    env.execute("UPDATE jobs SET lease_epoch = lease_epoch + 1 WHERE id = 'batch-b'")
        .await;
    // Three acks at once: two attempts of a sharing its lease, and b's zombie.
    let (a1, a2, stale) = tokio::join!(
        env.store.journal().ack(&a.fence),
        env.store.journal().ack(&a.fence),
        env.store.journal().ack(&b.fence),
    );
    let mut of_a = vec![a1.unwrap(), a2.unwrap()];
    of_a.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(
        of_a,
        vec![Checkpoint::AlreadyAt(JobState::Acked), Checkpoint::Moved],
        "one ack of a moves it, the other finds it acked"
    );
    assert_eq!(stale.unwrap(), Checkpoint::LeaseLost);
    assert_eq!(history_count(&env, "batch-a", JobState::Acked).await, 1);
    assert_eq!(history_count(&env, "batch-b", JobState::Acked).await, 0);
    assert_eq!(env.job("batch-b").await.state, JobState::Delivered);
}
