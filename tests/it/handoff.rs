//! Hand-off at intake (`engine/src/node/handoff.rs`): a node whose engine has
//! room, and no queue to jump, inserts a new job already leased to itself in
//! intake's commit and runs it. These tests check that it is a real lease:
//! the job runs once, on that node, while another node idles beside it; a
//! node that dies after the hand-off leaves the job to another, which
//! resumes it once; a full node, or a job scheduled for later, goes through
//! the queue instead.

use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{JobState, Registry};
use onceflow_workflows::Completion;
use serde_json::{json, Value};

use crate::support::{post_job, serve_node_api};

const WAIT: Duration = Duration::from_secs(20);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

fn job(id: &str, hook: &str) -> Value {
    json!({
        "id": id,
        "workflow": "completion",
        "input": { "model": "m", "messages": [{ "role": "user", "content": "hi" }] },
        "webhook_url": hook,
    })
}

async fn worker_of(env: &TestEnv, id: &str, state: &str) -> Vec<String> {
    env.sql(&format!(
        "SELECT worker FROM job_history WHERE job_id = '{id}' AND state = '{state}'"
    ))
    .await
    .as_array()
    .unwrap()
    .iter()
    .map(|r| r["worker"].as_str().unwrap().to_owned())
    .collect()
}

/// Twenty jobs accepted by node A are born leased to it (attempt 1 in the
/// answer to the POST) and all run there, once each, while node B polls
/// beside it and takes none of them.
#[actix_rt::test]
async fn a_handed_off_job_runs_once_on_the_node_that_accepted_it() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.node_id = "node-a".into();
    let a = env.start(registry(), config);
    let mut config = env.config();
    config.node_id = "node-b".into();
    let _b = env.start(registry(), config);
    let base = serve_node_api(&env, registry(), &a);
    // Node A's first acquire leaves it room; until then it queues.
    let handoff = a.handoff();
    assert!(wait_until(WAIT, || async { handoff.budget() > 0 }).await);
    for i in 0..20 {
        let id = format!("h-{i}");
        let (status, body) = post_job(&base, &job(&id, &env.consumer.url())).await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["attempts"], 1, "born leased to node A: {body}");
    }
    for i in 0..20 {
        let id = format!("h-{i}");
        let view = env.wait_for(&id, JobState::Acked, WAIT).await;
        assert_eq!(view.attempts, 1, "{id}");
        assert_eq!(worker_of(&env, &id, "generated").await, vec!["node-a"]);
        let key = format!("job:{id}:generate");
        assert_eq!(env.provider.requests_for(&key), 1, "sent once: {key}");
        assert_eq!(env.provider.work_done(&key), 1);
        assert_eq!(env.consumer.deliveries_for(&id).len(), 1, "{id}");
    }
    let epochs = env
        .sql("SELECT count(*) AS n FROM jobs WHERE id LIKE 'h-%' AND lease_epoch = 1")
        .await;
    assert_eq!(epochs[0]["n"], 20, "one lease each, never taken over");
}

/// Node A accepts the job, leased to itself, and its attempt dies at its
/// first model-call checkpoint; A goes down. Node
/// B resumes the job once A's lease lapses: one model call, one delivery,
/// the second attempt, B's.
#[actix_rt::test]
async fn a_node_that_dies_after_a_hand_off_leaves_the_job_to_another() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.node_id = "node-a".into();
    let a = env.start(registry(), config);
    let base = serve_node_api(&env, registry(), &a);
    let handoff = a.handoff();
    assert!(wait_until(WAIT, || async { handoff.budget() > 0 }).await);
    env.faults.arm(
        Some("h-crash"),
        FailPoint::BeforeCommit("model_call"),
        Action::Crash,
        1,
    );
    let (status, body) = post_job(&base, &job("h-crash", &env.consumer.url())).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["attempts"], 1, "handed off: {body}");
    assert!(wait_until(WAIT, || async { env.faults.fired("h-crash") }).await);
    a.shutdown();
    let mut config = env.config();
    config.node_id = "node-b".into();
    let b = env.start(registry(), config);
    let view = env.wait_for("h-crash", JobState::Acked, WAIT).await;
    assert_eq!(view.attempts, 2);
    assert_eq!(
        worker_of(&env, "h-crash", "generated").await,
        vec!["node-b"]
    );
    assert_eq!(env.provider.work_done("job:h-crash:generate"), 1);
    assert_eq!(
        env.provider.requests_for("job:h-crash:generate"),
        2,
        "the unjournaled answer was asked for again, once, under its key"
    );
    assert_eq!(env.provider.total_work(), 1, "no work under another key");
    assert_eq!(env.consumer.deliveries_for("h-crash").len(), 1);
    assert_eq!(
        b.counters()
            .takeovers
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "B took over A's lease"
    );
}

/// A node with room for one job hands off the first and queues the second
/// (attempt 0 at intake: not leased); a job scheduled for later is never
/// handed off. All three run once.
#[actix_rt::test]
async fn a_full_node_or_a_later_job_goes_through_the_queue() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(400));
    let mut config = env.config();
    config.max_in_flight = 1;
    let a = env.start(registry(), config);
    let base = serve_node_api(&env, registry(), &a);
    let handoff = a.handoff();
    assert!(wait_until(WAIT, || async { handoff.budget() > 0 }).await);
    // With room, a job scheduled for later still waits in the queue.
    let mut later = job("h-later", &env.consumer.url());
    later["delay_ms"] = json!(300);
    let (status, later) = post_job(&base, &later).await;
    assert_eq!(status, 201, "{later}");
    assert_eq!(later["attempts"], 0, "scheduled: queued: {later}");
    assert_eq!(handoff.reserved(), 0, "its room given back");
    let (_, first) = post_job(&base, &job("h-first", &env.consumer.url())).await;
    assert_eq!(first["attempts"], 1, "room for one: {first}");
    let (_, second) = post_job(&base, &job("h-second", &env.consumer.url())).await;
    assert_eq!(second["attempts"], 0, "full: queued: {second}");
    for id in ["h-first", "h-second", "h-later"] {
        env.wait_for(id, JobState::Acked, WAIT).await;
        let key = format!("job:{id}:generate");
        assert_eq!(env.provider.requests_for(&key), 1, "sent once: {key}");
        assert_eq!(env.provider.work_done(&key), 1);
        assert_eq!(env.consumer.deliveries_for(id).len(), 1, "{id}");
    }
    assert_eq!(
        handoff.reserved(),
        0,
        "every reservation adopted or given back"
    );
}

/// Intake's commit lands, leased to node A, but its answer is lost
/// (failpoint `after-commit:intake`): the POST fails with 503 and no actor
/// starts. A must not leave the job to its 60 s lease: it takes its own
/// orphaned lease back at once (epoch 2, attempt 2) and runs the job once.
/// The client's retry of the POST finds the job.
#[actix_rt::test]
async fn a_hand_off_whose_answer_is_lost_is_taken_back_at_once() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.node_id = "node-a".into();
    config.lease = Duration::from_secs(60);
    let a = env.start(registry(), config);
    let base = serve_node_api(&env, registry(), &a);
    let handoff = a.handoff();
    assert!(wait_until(WAIT, || async { handoff.budget() > 0 }).await);
    env.faults.arm(
        Some("h-lost"),
        FailPoint::AfterCommit("intake"),
        Action::Fail,
        1,
    );
    let (status, body) = post_job(&base, &job("h-lost", &env.consumer.url())).await;
    assert_eq!(status, 503, "{body}");
    assert!(env.faults.fired("h-lost"), "the failpoint fired");
    // Well inside the 60 s lease the commit wrote.
    let view = env
        .wait_for("h-lost", JobState::Acked, Duration::from_secs(15))
        .await;
    assert_eq!(view.attempts, 2, "taken back under a new lease");
    assert_eq!(worker_of(&env, "h-lost", "generated").await, vec!["node-a"]);
    assert_eq!(env.provider.requests_for("job:h-lost:generate"), 1);
    assert_eq!(env.consumer.deliveries_for("h-lost").len(), 1);
    let (status, body) = post_job(&base, &job("h-lost", &env.consumer.url())).await;
    assert_eq!(status, 200, "the retry finds the job: {body}");
    assert_eq!(body["state"], "acked");
}

/// A hand-off that starts while an acquire takes back this node's own
/// leases (`ReclaimOwn`) is not handed: that acquire read the jobs being
/// handed before it, and would take the new lease back under a newer epoch
/// while the first actor's model call is on its way. The job goes through
/// the queue: one model request, one actor, attempt 1.
#[actix_rt::test]
async fn a_hand_off_during_a_reclaim_goes_through_the_queue() {
    use onceflow_engine::node::supervisor::{ReclaimOwn, ACQUIRE_FAULT_ID};
    let env = TestEnv::new().await;
    // The model call outlasts the held acquire.
    env.provider.set_latency(Duration::from_secs(4));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(10);
    // One poll at a time to hold: the next is seconds away.
    config.poll_interval = Duration::from_secs(5);
    let node = env.start(registry(), config);
    let base = serve_node_api(&env, registry(), &node);
    // The first acquire has answered: hand-offs are open.
    assert!(wait_until(WAIT, || async { node.handoff().budget() > 0 }).await);
    env.faults.arm(
        Some(ACQUIRE_FAULT_ID),
        FailPoint::BeforeCommit("acquire"),
        Action::Stall(Duration::from_secs(2)),
        1,
    );
    node.supervisor().do_send(ReclaimOwn);
    assert!(
        wait_until(WAIT, || async {
            env.faults
                .fired_at(ACQUIRE_FAULT_ID, FailPoint::BeforeCommit("acquire"))
        })
        .await,
        "the reclaim's acquire was held"
    );
    let (status, answer) = post_job(&base, &job("during-reclaim", &env.consumer.url())).await;
    assert_eq!(status, 201, "{answer}");
    let view = env.wait_for("during-reclaim", JobState::Acked, WAIT).await;
    assert_eq!(
        env.provider.requests_for("job:during-reclaim:generate"),
        1,
        "one model request: no second actor under a newer epoch"
    );
    assert_eq!(view.attempts, 1, "{view:?}");
}
