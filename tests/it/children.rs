//! Child jobs (`ctx.spawn`, `ctx.join`): a parent fans out to children of
//! any registered workflow and fans back in. Each child is created once
//! (its id derived from the parent's and the spawn's name), paid once,
//! sends no webhook of its own unless given one, belongs to the parent's
//! token and continues its trace; the parent waits holding no lease, a dead
//! child is an error its code handles, and cancelling the parent cancels
//! its live children.

use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::{wait_until, Behaviour, TestEnv};
use onceflow_engine::{Context, JobState, Registry, StepError, Workflow};
use onceflow_workflows::Completion;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

/// Asks one completion child per prompt and collects their answers.
pub(crate) struct FanOut;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Prompts {
    prompts: Vec<String>,
    /// Where each child posts its own completion webhook, if anywhere.
    #[serde(default)]
    child_webhook: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Collected {
    /// Each child's answer, or `null` when it failed.
    answers: Vec<Option<String>>,
    /// The children that did not end acked: (id, state).
    failed: Vec<(String, String)>,
}

impl Workflow for FanOut {
    const NAME: &'static str = "test.fan_out";
    type Input = Prompts;
    type Output = Collected;

    async fn run(&self, ctx: &mut Context, input: Prompts) -> Result<Collected, StepError> {
        let mut children = Vec::new();
        for (i, prompt) in input.prompts.iter().enumerate() {
            let name = format!("c{i}");
            let child =
                json!({ "model": "m", "messages": [{ "role": "user", "content": prompt }] });
            children.push(match &input.child_webhook {
                Some(url) => {
                    ctx.spawn_with_webhook(&name, "completion", &child, url)
                        .await?
                }
                None => ctx.spawn(&name, "completion", &child).await?,
            });
        }
        let mut collected = Collected {
            answers: Vec::new(),
            failed: Vec::new(),
        };
        for outcome in ctx.join(&children, Duration::from_secs(300)).await? {
            match outcome {
                Ok(output) => collected
                    .answers
                    .push(output["content"].as_str().map(str::to_owned)),
                Err(failed) => {
                    collected.answers.push(None);
                    collected.failed.push((failed.id, failed.state));
                }
            }
        }
        Ok(collected)
    }
}

pub(crate) fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r.register(FanOut);
    r
}

pub(crate) fn parent(
    env: &TestEnv,
    id: &str,
    prompts: &[&str],
    child_webhook: Option<&str>,
) -> NewJob {
    NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: FanOut::NAME.to_owned(),
        workflow_version: 1,
        input: json!({ "prompts": prompts, "child_webhook": child_webhook }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    }
}

/// The test config with room enough that a loaded machine never gives up
/// on a refused model call: a call it gave up on is retried under its key,
/// and the retry answered, so the refusal a test scripted would be lost.
fn patient(env: &TestEnv) -> onceflow_engine::EngineConfig {
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(20);
    config
}

fn child(parent: &str, i: usize) -> String {
    format!("{parent}:child:c{i}")
}

fn gen_key(id: &str) -> String {
    format!("job:{id}:generate")
}

async fn count(env: &TestEnv, query: &str) -> i64 {
    env.sql(&format!("SELECT count(*) AS n FROM ({query}) q"))
        .await[0]["n"]
        .as_i64()
        .unwrap()
}

/// Three children, created once each (incarnation 1, one `received` row),
/// each model call paid and sent once, no child webhook, one parent
/// webhook after the join; the parent waited holding no lease (kind
/// `children`), and the views link both ways. The children belong to the
/// parent's token and continue its trace.
#[actix_rt::test]
async fn a_parent_fans_out_to_children_and_joins_them_once_each() {
    let env = TestEnv::new().await;
    // The children take a while: the parent reaches its join first.
    env.provider.set_latency(Duration::from_millis(300));
    let token = env.store.tokens().create("tenant", false).await.unwrap();
    let owner = env
        .store
        .tokens()
        .authenticate(&token)
        .await
        .unwrap()
        .map(|c| c.token);
    let _engine = env.start(registry(), env.config());
    let job = parent(&env, "fan-1", &["a", "b", "c"], None);
    let trace = onceflow_engine::rules::traceparent::TraceParent::new_root();
    env.store
        .jobs()
        .submit(
            &onceflow_engine::store::Submission::new(&job)
                .traced(trace)
                .owned(owner, false),
        )
        .await
        .unwrap();
    // One read of the row: while it waits for its children, no lease.
    let seen = std::sync::Mutex::new(Value::Null);
    let waited = wait_until(WAIT, || async {
        let row = env
            .sql("SELECT waiting, lease_owner, lease_expires_at FROM jobs WHERE id = 'fan-1'")
            .await[0]
            .clone();
        let waiting = row["waiting"]["kind"] == "children";
        if waiting {
            *seen.lock().unwrap() = row;
        }
        waiting
    })
    .await;
    let seen = seen.into_inner().unwrap();
    assert!(waited, "the parent waits for its children");
    assert!(
        seen["lease_owner"].is_null() && seen["lease_expires_at"].is_null(),
        "waiting, the parent holds no lease: {seen}"
    );
    // The wait says what it waits for: its join's name, its time, and the
    // children still pending (as many as listed).
    let waiting = &seen["waiting"];
    assert_eq!(waiting["name"], "join:1", "{seen}");
    assert!(waiting["until"].is_string(), "{seen}");
    let pending = waiting["children"].as_array().cloned().unwrap_or_default();
    assert!(!pending.is_empty(), "{seen}");
    assert_eq!(waiting["pending"], json!(pending.len()), "{seen}");
    for id in &pending {
        assert!(
            (0..3).any(|i| id == &json!(child("fan-1", i))),
            "{id} is one of the children: {seen}"
        );
    }
    let view = env.wait_for("fan-1", JobState::Acked, WAIT).await;
    let out: Collected = serde_json::from_value(view.result.clone().unwrap()).unwrap();
    assert_eq!(out.answers.len(), 3);
    assert!(out.answers.iter().all(Option::is_some), "{out:?}");
    assert!(out.failed.is_empty(), "{out:?}");
    let listed: Vec<(String, String)> = view
        .children
        .iter()
        .map(|c| (c.id.clone(), c.state.clone()))
        .collect();
    let expected: Vec<(String, String)> = (0..3)
        .map(|i| (child("fan-1", i), "acked".to_owned()))
        .collect();
    assert_eq!(listed, expected);
    let parent_trace = view.trace_id.clone().unwrap();
    for i in 0..3 {
        let id = child("fan-1", i);
        let c = env.job(&id).await;
        assert_eq!(c.parent.as_deref(), Some("fan-1"));
        assert_eq!(c.state, JobState::Acked);
        assert_eq!(c.incarnation, 1, "{id} created once");
        assert_eq!(c.owner_token, owner, "{id} belongs to the parent's token");
        assert_eq!(
            c.trace_id.as_deref(),
            Some(parent_trace.as_str()),
            "{id} continues the parent's trace"
        );
        assert_eq!(
            env.provider.requests_for(&gen_key(&id)),
            1,
            "{id} sent once"
        );
        assert_eq!(env.provider.work_done(&gen_key(&id)), 1);
        assert_eq!(
            env.consumer.deliveries_for(&id).len(),
            0,
            "{id} has no webhook"
        );
        let received = count(
            &env,
            &format!("SELECT 1 FROM job_history WHERE job_id = '{id}' AND state = 'received'"),
        )
        .await;
        assert_eq!(received, 1, "{id}: one intake");
    }
    assert_eq!(
        env.consumer.deliveries_for("fan-1").len(),
        1,
        "one parent webhook"
    );
    assert_eq!(env.provider.requests().len(), 3, "no other model call");
    let joins = count(
        &env,
        "SELECT 1 FROM waits WHERE job_id = 'fan-1' AND kind = 'children' AND outcome IS NOT NULL",
    )
    .await;
    assert_eq!(joins, 1, "one journaled join");
}

/// One child's model call is refused for good: that child dies, and the
/// parent's join hands it over as an error the parent's code records; the
/// parent still ends acked, with one webhook.
#[actix_rt::test]
async fn a_dead_child_is_an_error_the_parent_handles() {
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    let _engine = env.start(registry(), patient(&env));
    env.submit_job(parent(&env, "fan-dead", &["a", "b"], None))
        .await;
    let view = env.wait_for("fan-dead", JobState::Acked, WAIT).await;
    let out: Collected = serde_json::from_value(view.result.unwrap()).unwrap();
    assert_eq!(out.failed.len(), 1, "{out:?}");
    let (dead, state) = &out.failed[0];
    assert_eq!(state, "dead");
    assert_eq!(env.job(dead).await.state, JobState::Dead);
    assert_eq!(out.answers.iter().filter(|a| a.is_some()).count(), 1);
    assert_eq!(env.consumer.deliveries_for("fan-dead").len(), 1);
}

/// Cancelling a parent that waits for its children cancels them too: none
/// is left running, and nothing is delivered.
#[actix_rt::test]
async fn cancelling_a_parent_cancels_its_live_children() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(20));
    // A timeout the calls never reach: a re-sent call would change the count.
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    let _engine = env.start(registry(), config);
    env.submit_job(parent(&env, "fan-cancel", &["a", "b", "c"], None))
        .await;
    let started = wait_until(WAIT, || async {
        env.provider.requests().len() == 3
            && env
                .job("fan-cancel")
                .await
                .waiting
                .is_some_and(|w| w["kind"] == "children")
    })
    .await;
    assert!(started, "three children in flight, the parent waiting");
    env.store
        .jobs()
        .cancel("fan-cancel", "test", "no longer needed")
        .await
        .unwrap();
    assert_eq!(env.job("fan-cancel").await.state, JobState::Cancelled);
    for i in 0..3 {
        assert_eq!(
            env.job(&child("fan-cancel", i)).await.state,
            JobState::Cancelled,
            "child {i}"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.consumer.deliveries().len(), 0, "nothing delivered");
}

/// A cascade cancel is one transaction: a database that fails on the
/// second child's cancel leaves the parent and every child as they were
/// (never the parent cancelled with children running on), and the cancel
/// asked again cancels them all. A cancel of a parent cancelled already
/// (a cascade an older node cut short) still cancels the children it left.
#[actix_rt::test]
async fn a_cascade_cancel_is_all_or_nothing_and_a_repeat_finishes_it() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(30));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    // A fault for the cascade: the database refuses to cancel one child.
    // (Installed first: DDL on `jobs` waits for every open transaction.)
    env.execute(
        "CREATE FUNCTION refuse_cancel() RETURNS trigger AS $$ BEGIN \
             IF NEW.state = 'cancelled' AND NEW.id = 'fan-atomic:child:c1' THEN \
                 RAISE EXCEPTION 'injected: the database fails mid-cascade' \
                     USING ERRCODE = 'check_violation'; END IF; \
             RETURN NEW; END $$ LANGUAGE plpgsql",
    )
    .await;
    env.execute(
        "CREATE TRIGGER refuse_cancel BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION refuse_cancel()",
    )
    .await;
    let _engine = env.start(registry(), config);
    for id in ["fan-atomic", "fan-cut"] {
        env.submit_job(parent(&env, id, &["a", "b", "c"], None))
            .await;
    }
    let started = wait_until(WAIT, || async {
        count(
            &env,
            "SELECT id FROM jobs WHERE parent_id IS NOT NULL AND lease_owner IS NOT NULL",
        )
        .await
            == 6
            && env.job("fan-atomic").await.waiting.is_some()
            && env.job("fan-cut").await.waiting.is_some()
    })
    .await;
    assert!(started, "six children in flight, both parents waiting");
    let failed = env.store.jobs().cancel("fan-atomic", "test", "stop").await;
    assert!(failed.is_err(), "the injected fault fired: {failed:?}");
    let live = "SELECT id FROM jobs WHERE (id = 'fan-atomic' OR parent_id = 'fan-atomic') \
                AND finished_at IS NULL";
    assert_eq!(count(&env, live).await, 4, "nothing was cancelled");
    env.execute("DROP TRIGGER refuse_cancel ON jobs").await;
    let cancelled = env
        .store
        .jobs()
        .cancel("fan-atomic", "test", "stop")
        .await
        .unwrap();
    assert_eq!(cancelled, onceflow_engine::store::operate::Cancelled::Now);
    assert_eq!(count(&env, live).await, 0, "the parent and its children");

    // A cascade cut short after the parent's commit (as an older node's
    // was): the repeat finds the parent cancelled and finishes the tree.
    env.execute(
        "UPDATE jobs SET state = 'cancelled', finished_at = now(), lease_owner = NULL, \
             lease_expires_at = NULL, lease_epoch = lease_epoch + 1 WHERE id = 'fan-cut'",
    )
    .await;
    let again = env
        .store
        .jobs()
        .cancel("fan-cut", "test", "stop")
        .await
        .unwrap();
    assert_eq!(again, onceflow_engine::store::operate::Cancelled::Already);
    for i in 0..3 {
        assert_eq!(
            env.job(&child("fan-cut", i)).await.state,
            JobState::Cancelled,
            "child {i}"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.provider.requests().len(),
        6,
        "each child called the model once, none again"
    );
    assert_eq!(env.consumer.deliveries().len(), 0, "nothing delivered");
}

/// A parent acked, purged and submitted again (incarnation 2) makes
/// children of its own: it never finds its first life's child (still
/// kept, finished later than the parent), so each life's model call is made.
#[actix_rt::test]
async fn a_new_incarnation_of_a_parent_makes_new_children() {
    let env = TestEnv::new().await;
    let _engine = env.start(registry(), env.config());
    env.submit_job(parent(&env, "inc", &["a"], None)).await;
    env.wait_for("inc", JobState::Acked, WAIT).await;
    // The parent's retention has passed; its child's has not.
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id = 'inc'")
        .await;
    let purged = env
        .store
        .retention()
        .purge_finished(3_600_000, 100)
        .await
        .unwrap();
    assert_eq!(purged, 1, "the parent alone");
    assert_eq!(env.job("inc:child:c0").await.state, JobState::Acked);
    env.submit_job(parent(&env, "inc", &["a"], None)).await;
    let view = env.wait_for("inc", JobState::Acked, WAIT).await;
    assert_eq!(view.incarnation, 2);
    let second = "inc:child.2:c0";
    assert_eq!(env.job(second).await.state, JobState::Acked);
    assert_eq!(env.provider.requests_for(&gen_key("inc:child:c0")), 1);
    assert_eq!(env.provider.requests_for(&gen_key(second)), 1);
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'inc'").await,
        2,
        "one child per life"
    );
}

/// The parent's attempt crashes after its child is made, and the replay
/// runs on a node that lacks the child's workflow: it finds the child it
/// made (never `invalid_child`), and a node that has it runs the child.
#[actix_rt::test]
async fn a_replay_finds_its_child_on_a_node_without_the_childs_workflow() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    env.faults.arm(
        Some("fan-away"),
        FailPoint::AfterCommit("spawn"),
        Action::Crash,
        1,
    );
    let first = env.start(registry(), env.config());
    env.submit_job(parent(&env, "fan-away", &["a"], None)).await;
    assert!(
        wait_until(WAIT, || async {
            env.faults
                .fired_at("fan-away", FailPoint::AfterCommit("spawn"))
        })
        .await
    );
    first.shutdown();
    let mut parents = Registry::new();
    parents.register(FanOut);
    let mut children = Registry::new();
    children.register(Completion::default());
    let _b = env.start(parents, env.config());
    let _c = env.start(children, env.config());
    let view = env.wait_for("fan-away", JobState::Acked, WAIT).await;
    assert!(view.attempts >= 2, "taken over after the crash");
    let id = child("fan-away", 0);
    assert_eq!(env.job(&id).await.state, JobState::Acked);
    // Its model call may be asked again after the crash, under its key:
    // the work is done once.
    assert_eq!(env.provider.work_done(&gen_key(&id)), 1);
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'fan-away'").await,
        1
    );
}

/// Joins one slow child, with the timeout its input names (`join_s`).
struct Impatient;

impl Workflow for Impatient {
    const NAME: &'static str = "test.impatient";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, input: Value) -> Result<Value, StepError> {
        let join = Duration::from_secs(input["join_s"].as_u64().unwrap_or(1));
        let input = json!({ "model": "m", "messages": [{ "role": "user", "content": "slow" }] });
        let child = ctx.spawn("slow", "completion", &input).await?;
        let outcome = ctx.join(&[child], join).await?;
        Ok(match outcome.into_iter().next().expect("one child") {
            Ok(_) => json!({ "joined": "acked" }),
            Err(failed) => json!({ "joined": failed.state }),
        })
    }
}

/// A join times out at its time, as the guide promises: the parent goes
/// on with the child's state then (`received`, still running), without
/// waiting for the child to finish.
#[actix_rt::test]
async fn a_join_times_out_at_its_time() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(8));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(30);
    let mut r = registry();
    r.register(Impatient);
    let _engine = env.start(r, config);
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "impatient".into(),
        workflow: Impatient::NAME.into(),
        workflow_version: 1,
        input: json!({ "join_s": 1 }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let view = env
        .wait_for("impatient", JobState::Acked, Duration::from_secs(6))
        .await;
    assert_eq!(view.result.unwrap(), json!({ "joined": "received" }));
    assert_eq!(
        env.job("impatient:child:slow").await.state,
        JobState::Received,
        "the child still runs"
    );
}

/// A child cancelled while its parent waits is an outcome the parent gets
/// at once (`cancelled`), long before the join's timeout.
#[actix_rt::test]
async fn a_cancelled_child_ends_its_parents_join_at_once() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(30));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    let mut r = registry();
    r.register(Impatient);
    let _engine = env.start(r, config);
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "patient".into(),
        workflow: Impatient::NAME.into(),
        workflow_version: 1,
        input: json!({ "join_s": 300 }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let waiting = wait_until(WAIT, || async {
        env.job("patient")
            .await
            .waiting
            .is_some_and(|w| w["kind"] == "children")
    })
    .await;
    assert!(waiting, "the parent waits for its child");
    env.store
        .jobs()
        .cancel("patient:child:slow", "test", "not needed")
        .await
        .unwrap();
    let view = env
        .wait_for("patient", JobState::Acked, Duration::from_secs(10))
        .await;
    assert_eq!(view.result.unwrap(), json!({ "joined": "cancelled" }));
}

/// A child given a `webhook_url` sends its own completion webhook, once.
#[actix_rt::test]
async fn a_child_given_a_webhook_sends_its_own_once() {
    let env = TestEnv::new().await;
    let _engine = env.start(registry(), env.config());
    let hook = env.consumer.url();
    env.submit_job(parent(&env, "fan-hook", &["a", "b"], Some(&hook)))
        .await;
    env.wait_for("fan-hook", JobState::Acked, WAIT).await;
    for i in 0..2 {
        let id = child("fan-hook", i);
        assert_eq!(env.consumer.deliveries_for(&id).len(), 1, "{id}");
        assert_eq!(env.consumer.processed_for(&id), 1, "{id}");
    }
    assert_eq!(env.consumer.deliveries_for("fan-hook").len(), 1);
}

/// The parent's attempt crashes just after its second child is created,
/// and again just before its join is journaled: the attempts that take
/// over find the children already there (created once each) and pay for
/// each model call once; one parent webhook.
#[actix_rt::test]
async fn children_are_created_once_through_crashes_of_the_parent() {
    let env = TestEnv::new().await;
    env.faults.arm_nth(
        "fan-crash",
        FailPoint::AfterCommit("spawn"),
        Action::Crash,
        2,
    );
    env.faults.arm(
        Some("fan-crash"),
        FailPoint::BeforeCommit("join"),
        Action::Crash,
        1,
    );
    let _engine = env.start(registry(), env.config());
    env.submit_job(parent(&env, "fan-crash", &["a", "b", "c"], None))
        .await;
    let view = env.wait_for("fan-crash", JobState::Acked, WAIT).await;
    for point in [
        FailPoint::AfterCommit("spawn"),
        FailPoint::BeforeCommit("join"),
    ] {
        assert!(env.faults.fired_at("fan-crash", point), "{point} fired");
    }
    assert!(view.attempts >= 3, "two crashes, taken over twice");
    for i in 0..3 {
        let id = child("fan-crash", i);
        let c = env.job(&id).await;
        assert_eq!((c.state, c.incarnation), (JobState::Acked, 1), "{id}");
        assert_eq!(env.provider.requests_for(&gen_key(&id)), 1, "{id}");
    }
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'fan-crash'").await,
        3
    );
    assert_eq!(env.consumer.deliveries_for("fan-crash").len(), 1);
}

/// Spawns child `c0` and joins it, passing a failed child on with `?`.
struct Strict;

impl Workflow for Strict {
    const NAME: &'static str = "test.strict";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let input = json!({ "model": "m", "messages": [{ "role": "user", "content": "strict" }] });
        let child = ctx.spawn("c0", "completion", &input).await?;
        let out = ctx.join(&[child], Duration::from_secs(300)).await?;
        Ok(out.into_iter().next().expect("one child")?)
    }
}

/// Spawns child `c0` with the input it reads from a counter that changes on
/// every run of the body.
struct Fickle {
    runs: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl Workflow for Fickle {
    const NAME: &'static str = "test.fickle";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let input = json!({ "model": "m", "messages": [{ "role": "user", "content": format!("run {n}") }] });
        ctx.spawn("c0", "completion", &input).await?;
        Ok(json!(n))
    }
}

/// Joins a child that does not exist.
struct JoinsNobody;

impl Workflow for JoinsNobody {
    const NAME: &'static str = "test.joins_nobody";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let nobody = onceflow_engine::context::Child {
            id: "nobody".into(),
            name: "nobody".into(),
        };
        let out = ctx.join(&[nobody], Duration::from_secs(300)).await?;
        Ok(match out.into_iter().next().expect("one outcome") {
            Ok(_) => json!("acked"),
            Err(failed) => json!(failed.state),
        })
    }
}

fn promise_registry(runs: &std::sync::Arc<std::sync::atomic::AtomicU32>) -> Registry {
    let mut r = registry();
    r.register(Fickle { runs: runs.clone() });
    r.register(Strict);
    r.register(JoinsNobody);
    r
}

async fn submit_plain(env: &TestEnv, id: &str, workflow: &str, priority: i32) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: workflow.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: onceflow_engine::request::Schedule {
            priority,
            ..Default::default()
        },
    })
    .await;
}

/// A replay that starts a name's child again with another input fails the
/// parent (`child_conflict`) and makes no second child; the guide promises
/// it.
#[actix_rt::test]
async fn a_child_started_again_with_another_input_is_child_conflict() {
    let env = TestEnv::new().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    env.faults.arm(
        Some("fickle"),
        FailPoint::AfterCommit("spawn"),
        Action::Crash,
        1,
    );
    let _engine = env.start(promise_registry(&runs), env.config());
    submit_plain(&env, "fickle", "test.fickle", 0).await;
    let view = env.wait_for("fickle", JobState::Dead, WAIT).await;
    assert!(env
        .faults
        .fired_at("fickle", FailPoint::AfterCommit("spawn")));
    assert_eq!(view.last_error.unwrap().code, "child_conflict");
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'fickle'").await,
        1,
        "no second child"
    );
}

/// A child runs at its parent's priority; a child that is not there is
/// `missing` to the join; a failed child passed on with `?` fails the
/// parent as `child_failed`, naming the child.
#[actix_rt::test]
async fn children_keep_their_parents_priority_and_a_failed_one_fails_the_parent_by_question_mark() {
    let env = TestEnv::new().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    env.provider.push(Behaviour::Status(400, None));
    let _engine = env.start(promise_registry(&runs), patient(&env));
    submit_plain(&env, "urgent", "test.strict", 7).await;
    let view = env.wait_for("urgent", JobState::Dead, WAIT).await;
    let child = env.job("urgent:child:c0").await;
    assert_eq!(child.priority, 7, "the parent's priority");
    assert_eq!(child.state, JobState::Dead);
    let error = view.last_error.unwrap();
    assert_eq!(error.code, "child_failed");
    assert!(
        error.message.contains("urgent:child:c0"),
        "{}",
        error.message
    );
    submit_plain(&env, "lonely", "test.joins_nobody", 0).await;
    let view = env.wait_for("lonely", JobState::Acked, WAIT).await;
    assert_eq!(view.result.unwrap(), json!("missing"));
}

/// Spawns one child as its input says (name, workflow, input) and joins it.
struct SpawnsAsTold;

impl Workflow for SpawnsAsTold {
    const NAME: &'static str = "test.spawns_as_told";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, told: Value) -> Result<Value, StepError> {
        let name = told["name"].as_str().unwrap_or("c0");
        let workflow = told["workflow"].as_str().unwrap_or("completion");
        let child = ctx.spawn(name, workflow, &told["input"]).await?;
        let out = ctx.join(&[child], Duration::from_secs(300)).await?;
        Ok(out.into_iter().next().expect("one child")?)
    }
}

/// Spawns `b` ("first") then `a` ("second"): the spawn order is not the
/// children's id order. Returns each answer in the join's order.
struct Ordered;

impl Workflow for Ordered {
    const NAME: &'static str = "test.ordered";
    type Input = Value;
    type Output = Vec<String>;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Vec<String>, StepError> {
        let mut children = Vec::new();
        for (name, prompt) in [("b", "first"), ("a", "second")] {
            let input =
                json!({ "model": "m", "messages": [{ "role": "user", "content": prompt }] });
            children.push(ctx.spawn(name, "completion", &input).await?);
        }
        let mut answers = Vec::new();
        for outcome in ctx.join(&children, Duration::from_secs(300)).await? {
            answers.push(outcome?["content"].as_str().unwrap_or_default().to_owned());
        }
        Ok(answers)
    }
}

fn told_registry() -> Registry {
    let mut r = registry();
    r.register(SpawnsAsTold);
    r.register(Ordered);
    r.register(Strict);
    r
}

async fn submit_told(env: &TestEnv, id: &str, told: Value) {
    env.submit_job(NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: SpawnsAsTold::NAME.into(),
        workflow_version: 1,
        input: told,
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// A child must name a registered workflow, pass its input's validation and
/// have a valid name: else the parent dies `invalid_child` and no child
/// row exists (the guide promises it).
#[actix_rt::test]
async fn a_child_the_registry_refuses_is_invalid_child_and_makes_nothing() {
    let env = TestEnv::new().await;
    let _engine = env.start(told_registry(), env.config());
    let good = json!({ "model": "m", "messages": [{ "role": "user", "content": "x" }] });
    let cases = [
        (
            "unknown-wf",
            json!({ "workflow": "no.such.workflow", "input": good }),
        ),
        (
            "bad-input",
            json!({ "workflow": "completion", "input": { "model": "m" } }),
        ),
        (
            "bad-name",
            json!({ "name": "a name with spaces", "input": good }),
        ),
    ];
    for (id, told) in &cases {
        submit_told(&env, id, told.clone()).await;
    }
    for (id, _) in &cases {
        let view = env.wait_for(id, JobState::Dead, WAIT).await;
        assert_eq!(view.last_error.unwrap().code, "invalid_child", "{id}");
        assert_eq!(
            count(
                &env,
                &format!("SELECT 1 FROM jobs WHERE parent_id = '{id}'")
            )
            .await,
            0,
            "{id}: no child"
        );
    }
    assert_eq!(env.provider.requests().len(), 0, "no model call");
}

/// A cancel that lands while an attempt is about to commit its spawn (the
/// attempt frozen there): the cancelled parent has no child and no model
/// call is made for one. Two things stop it, and each alone holds (each
/// was undone by hand with the other in place): the node aborts the
/// cancelled job's attempt, and the spawn's commit is fenced by the lease
/// epoch the cancel moved on.
#[actix_rt::test]
async fn a_spawn_after_its_parent_was_cancelled_makes_no_child() {
    let env = TestEnv::new().await;
    env.faults.arm(
        Some("late-spawn"),
        FailPoint::BeforeCommit("spawn"),
        Action::Freeze(Duration::from_secs(2)),
        1,
    );
    let _engine = env.start(told_registry(), env.config());
    let good = json!({ "model": "m", "messages": [{ "role": "user", "content": "x" }] });
    submit_told(&env, "late-spawn", json!({ "input": good })).await;
    assert!(
        wait_until(WAIT, || async {
            env.faults
                .fired_at("late-spawn", FailPoint::BeforeCommit("spawn"))
        })
        .await,
        "the attempt reached the spawn's commit"
    );
    env.store
        .jobs()
        .cancel("late-spawn", "test", "cancelled mid-spawn")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.job("late-spawn").await.state, JobState::Cancelled);
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'late-spawn'").await,
        0,
        "the fenced spawn made no child"
    );
    assert_eq!(env.provider.requests().len(), 0, "nothing sent for one");
}

/// The join returns one result per child in the order the children were
/// given, not their ids' order: `b` ("first") before `a` ("second").
#[actix_rt::test]
async fn a_join_returns_its_childrens_results_in_the_order_given() {
    let env = TestEnv::new().await;
    let _engine = env.start(told_registry(), env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "ordered".into(),
        workflow: Ordered::NAME.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let view = env.wait_for("ordered", JobState::Acked, WAIT).await;
    let answers: Vec<String> = serde_json::from_value(view.result.unwrap()).unwrap();
    assert_eq!(answers.len(), 2);
    assert!(answers[0].starts_with("echo: first"), "{answers:?}");
    assert!(answers[1].starts_with("echo: second"), "{answers:?}");
}

/// A child that ends makes its waiting parent due at once and wakes the
/// nodes: with a poll of a minute, the parent still finishes within
/// seconds of its child.
#[actix_rt::test]
async fn a_finished_child_wakes_its_parent_without_the_poll() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(500));
    let mut config = env.config();
    config.poll_interval = Duration::from_secs(60);
    let _engine = env.start(registry(), config);
    env.submit_job(parent(&env, "woken", &["a"], None)).await;
    let view = env
        .wait_for("woken", JobState::Acked, Duration::from_secs(20))
        .await;
    assert_eq!(view.state, JobState::Acked, "woken well before a poll");
}

/// A parent that died because its child failed (`child_failed`, passed on
/// with `?`) dies again when redriven, even after the child was redriven
/// and acked: the join it journaled is read back, never asked again.
#[actix_rt::test]
async fn a_redriven_parent_of_a_failed_child_dies_again() {
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    let _engine = env.start(told_registry(), patient(&env));
    submit_plain(&env, "strict", "test.strict", 0).await;
    env.wait_for("strict", JobState::Dead, WAIT).await;
    let child = "strict:child:c0";
    assert_eq!(env.job(child).await.state, JobState::Dead);
    env.store
        .jobs()
        .redrive(child, "test", "fixed", false)
        .await
        .unwrap();
    env.wait_for(child, JobState::Acked, WAIT).await;
    env.store
        .jobs()
        .redrive("strict", "test", "try again", false)
        .await
        .unwrap();
    assert!(
        wait_until(WAIT, || async {
            env.job("strict").await.attempts >= 2 && env.job("strict").await.state == JobState::Dead
        })
        .await,
        "the parent ran again and died again"
    );
    let view = env.job("strict").await;
    assert_eq!(view.last_error.unwrap().code, "child_failed");
    let joins = count(
        &env,
        "SELECT 1 FROM waits WHERE job_id = 'strict' AND kind = 'children'",
    )
    .await;
    assert_eq!(joins, 1, "one join, journaled, read back");
}

/// Retention keeps a finished child while its parent is live (waiting) or
/// dead, however old the child; it goes with its parent.
#[actix_rt::test]
async fn children_are_kept_while_their_parent_is_live_or_dead() {
    let env = TestEnv::new().await;
    env.provider.push(Behaviour::Status(400, None));
    let _engine = env.start(told_registry(), patient(&env));
    submit_plain(&env, "kept", "test.strict", 0).await;
    env.wait_for("kept", JobState::Dead, WAIT).await;
    env.execute(
        "UPDATE jobs SET finished_at = now() - interval '30 days' WHERE id = 'kept:child:c0'",
    )
    .await;
    env.store
        .retention()
        .purge_finished_keeping_dead(1000, 365 * 24 * 3600 * 1000, 100)
        .await
        .unwrap();
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE id = 'kept:child:c0'").await,
        1,
        "the dead parent's child is kept"
    );
}

/// A cancel takes the job's live children and theirs: a parent whose
/// child is itself a parent (a fan-out of two) cancels all four.
#[actix_rt::test]
async fn a_cancel_takes_grandchildren_too() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(20));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    let _engine = env.start(told_registry(), config);
    submit_told(
        &env,
        "grand",
        json!({ "workflow": FanOut::NAME, "input": { "prompts": ["x", "y"] } }),
    )
    .await;
    assert!(
        wait_until(WAIT, || async { env.provider.requests().len() == 2 }).await,
        "two grandchildren in flight"
    );
    env.store
        .jobs()
        .cancel("grand", "test", "stop")
        .await
        .unwrap();
    for id in [
        "grand",
        "grand:child:c0",
        "grand:child:c0:child:c0",
        "grand:child:c0:child:c1",
    ] {
        assert_eq!(env.job(id).await.state, JobState::Cancelled, "{id}");
    }
}

/// A bulk cancel (`POST /v1/jobs/cancel`) cancels a waiting parent as a
/// single cancel would: its live children with it, uncounted
/// (`{"cancelled": 1}`).
#[actix_rt::test]
async fn a_bulk_cancel_takes_each_parents_children_uncounted() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(20));
    let base = crate::support::serve_api(&env, registry(), None);
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    let _engine = env.start(registry(), config);
    env.submit_job(parent(&env, "bulk-parent", &["a", "b"], None))
        .await;
    assert!(
        wait_until(WAIT, || async {
            env.provider.requests().len() == 2
                && env
                    .job("bulk-parent")
                    .await
                    .waiting
                    .is_some_and(|w| w["kind"] == "children")
        })
        .await,
        "two children in flight, the parent waiting"
    );
    let listed: Value = reqwest::get(format!("{base}/v1/jobs?waiting=children"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = listed["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["bulk-parent"],
        "?waiting=children lists the parent alone"
    );
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/jobs/cancel"))
        .json(&json!({ "workflow": FanOut::NAME, "reason": "tidy" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body,
        json!({ "cancelled": 1 }),
        "the parent alone is counted"
    );
    for id in [
        "bulk-parent",
        &child("bulk-parent", 0),
        &child("bulk-parent", 1),
    ] {
        assert_eq!(env.job(id).await.state, JobState::Cancelled, "{id}");
    }
}

/// Spawns child `c0` of `completion` on its first run, of `test.ordered`
/// on every later one.
struct Fickler {
    runs: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl Workflow for Fickler {
    const NAME: &'static str = "test.fickler";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n == 0 {
            let input = json!({ "model": "m", "messages": [{ "role": "user", "content": "x" }] });
            ctx.spawn("c0", "completion", &input).await?;
        } else {
            ctx.spawn("c0", Ordered::NAME, &json!({})).await?;
        }
        Ok(json!(n))
    }
}

/// A replay that starts a name's child again as another workflow (same
/// name, other workflow) fails the parent `child_conflict` and makes no
/// second child, as another input does.
#[actix_rt::test]
async fn a_child_started_again_as_another_workflow_is_child_conflict() {
    let env = TestEnv::new().await;
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    env.faults.arm(
        Some("fickler"),
        FailPoint::AfterCommit("spawn"),
        Action::Crash,
        1,
    );
    let mut registry = told_registry();
    registry.register(Fickler { runs: runs.clone() });
    let _engine = env.start(registry, env.config());
    submit_plain(&env, "fickler", "test.fickler", 0).await;
    let view = env.wait_for("fickler", JobState::Dead, WAIT).await;
    assert!(env
        .faults
        .fired_at("fickler", FailPoint::AfterCommit("spawn")));
    assert_eq!(view.last_error.unwrap().code, "child_conflict");
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE parent_id = 'fickler'").await,
        1,
        "no second child"
    );
    assert_eq!(env.job("fickler:child:c0").await.workflow, "completion");
}

/// Waits for signal `go` (ten minutes at most), then ends.
struct AwaitsGo;

impl Workflow for AwaitsGo {
    const NAME: &'static str = "test.awaits_go";
    type Input = Value;
    type Output = bool;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<bool, StepError> {
        let go: Option<Value> = ctx.wait_for_signal("go", Duration::from_secs(600)).await?;
        Ok(go.is_some())
    }
}

/// Starts a child that waits for a signal, and ends without joining it.
struct LeavesBehind;

impl Workflow for LeavesBehind {
    const NAME: &'static str = "test.leaves_behind";
    type Input = Value;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<Value, StepError> {
        ctx.spawn("left-behind", AwaitsGo::NAME, &json!({})).await?;
        Ok(json!("done"))
    }
}

/// A child belongs to one life of its parent and to its owner, across
/// tokens. Alice's job ends leaving a child that waits: retention keeps the
/// finished parent while the child lives (its id stays Alice's: Bob's
/// submit under it is `409`). Where the parent was purged anyway (an older
/// node's retention did that), Bob's job under the same id is a new life:
/// its view lists none of Alice's children and its cancel cancels none.
#[actix_rt::test]
async fn a_reused_id_inherits_nothing_of_the_last_owners_children() {
    use crate::cron::call;
    let env = TestEnv::new().await;
    let mut registry = registry();
    registry.register(AwaitsGo);
    registry.register(LeavesBehind);
    let _engine = env.start(registry.clone(), env.config());
    let base = crate::support::serve_api_with_auth(
        &env,
        registry,
        onceflow_engine::api::Auth::Tokens { loopback: false },
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let post = reqwest::Method::POST;
    let jobs = format!("{base}/v1/jobs");
    let left = "reused:child:left-behind";

    let body = json!({ "id": "reused", "workflow": LeavesBehind::NAME, "input": {} });
    let (status, answer) = call(post.clone(), &jobs, Some(&alice), Some(&body)).await;
    assert_eq!(status, 201, "{answer}");
    env.wait_for("reused", JobState::Acked, WAIT).await;
    assert!(
        wait_until(WAIT, || async { env.job(left).await.waiting.is_some() }).await,
        "Alice's child waits for its signal"
    );

    // Retention: the parent's time is over, its child lives: it is kept.
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id = 'reused'")
        .await;
    let purged = env
        .store
        .retention()
        .purge_finished(3_600_000, 100)
        .await
        .unwrap();
    assert_eq!(purged, 0, "a parent is kept while its child lives");
    let bobs = json!({ "id": "reused", "workflow": AwaitsGo::NAME, "input": {} });
    let (status, answer) = call(post.clone(), &jobs, Some(&bob), Some(&bobs)).await;
    assert_eq!(status, 409, "the id is still Alice's: {answer}");

    // The state an older node's retention left: the parent purged (its
    // tombstone written), its child still waiting.
    env.execute(
        "WITH gone AS (DELETE FROM jobs WHERE id = 'reused' RETURNING id, incarnation, lease_epoch) \
         INSERT INTO job_tombstones (id, incarnation, last_epoch) \
         SELECT id, incarnation, lease_epoch FROM gone",
    )
    .await;
    let (status, answer) = call(post.clone(), &jobs, Some(&bob), Some(&bobs)).await;
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["incarnation"], 2, "{answer}");
    let (status, view) = call(
        reqwest::Method::GET,
        &format!("{jobs}/reused"),
        Some(&bob),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(view["children"], json!([]), "none of Alice's: {view}");
    let (status, answer) = call(
        post.clone(),
        &format!("{jobs}/reused/cancel"),
        Some(&bob),
        None,
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    env.wait_for("reused", JobState::Cancelled, WAIT).await;
    let child = env.job(left).await;
    assert!(
        !child.state.is_terminal() && child.waiting.is_some(),
        "Alice's child still waits: {:?}",
        child.state
    );
    let (status, view) = call(
        reqwest::Method::GET,
        &format!("{jobs}/{left}"),
        Some(&alice),
        None,
    )
    .await;
    assert_eq!((status, view["parent"].as_str()), (200, Some("reused")));
}

/// A cascade cancel takes every live descendant, however deep: a chain of
/// 100 live descendants (made by SQL: spawned children's 200-character ids
/// stop near 24 levels) is cancelled to its last link, as the API answers.
#[actix_rt::test]
async fn a_cascade_cancel_takes_a_tree_of_any_depth() {
    let env = TestEnv::new().await;
    let mut registry = registry();
    registry.register(AwaitsGo);
    let _engine = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "d0".into(),
        workflow: AwaitsGo::NAME.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: String::new(),
        schedule: Default::default(),
    })
    .await;
    assert!(
        wait_until(WAIT, || async { env.job("d0").await.waiting.is_some() }).await,
        "the root waits"
    );
    let made = env
        .execute(
            "INSERT INTO jobs SELECT (jsonb_populate_record(NULL::jobs, to_jsonb(j) || jsonb_build_object( \
                 'id', 'd' || g, 'parent_id', 'd' || (g - 1), 'parent_incarnation', 1))).* \
             FROM jobs j, generate_series(1, 100) g WHERE j.id = 'd0'",
        )
        .await;
    assert_eq!(made, 100);
    env.store.jobs().cancel("d0", "test", "stop").await.unwrap();
    assert_eq!(
        count(&env, "SELECT 1 FROM jobs WHERE state = 'cancelled'").await,
        101,
        "the root and every descendant"
    );
}

/// The parent of [`a_child_finishing_as_its_parent_joins_wakes_it`]: it
/// starts a child that waits, stops at a gate the test opens, then joins.
struct JoinRace;

static JOIN_READY: tokio::sync::Notify = tokio::sync::Notify::const_new();
static JOIN_GO: tokio::sync::Notify = tokio::sync::Notify::const_new();

impl Workflow for JoinRace {
    const NAME: &'static str = "test.join_race";
    type Input = Value;
    type Output = usize;

    async fn run(&self, ctx: &mut Context, _: Value) -> Result<usize, StepError> {
        let child = ctx.spawn("c", AwaitsGo::NAME, &json!({})).await?;
        ctx.step("gate", |_| async {
            JOIN_READY.notify_one();
            JOIN_GO.notified().await;
            Ok(true)
        })
        .await?;
        Ok(ctx.join(&[child], Duration::from_secs(300)).await?.len())
    }
}

/// A child that finishes while its parent's join decides wakes the parent:
/// the child's finish (held open in a transaction of the test) has run its
/// trigger while the parent was leased (no wake-up), and commits only once
/// the join is reading. The join waits for that commit (it share-locks the
/// children it reads) and finds the child finished; without the lock it
/// read the child live and let the parent wait for a wake-up that had
/// already passed (until the join's 300 s timeout).
#[actix_rt::test]
async fn a_child_finishing_as_its_parent_joins_wakes_it() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
    let env = TestEnv::new().await;
    let mut registry = registry();
    registry.register(AwaitsGo);
    registry.register(JoinRace);
    let _engine = env.start(registry, env.config());
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "race".into(),
        workflow: JoinRace::NAME.into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: String::new(),
        schedule: Default::default(),
    })
    .await;
    tokio::time::timeout(WAIT, JOIN_READY.notified())
        .await
        .expect("the parent reaches its gate");
    assert!(
        wait_until(WAIT, || async {
            env.sql(
                "SELECT count(*) AS n FROM jobs WHERE id = 'race:child:c' \
                     AND waiting IS NOT NULL AND lease_owner IS NULL",
            )
            .await[0]["n"]
                == json!(1)
        })
        .await,
        "the child waits, holding no lease"
    );
    let mut finish = AsyncPgConnection::establish(&env.db_url).await.unwrap();
    finish
        .batch_execute(
            "BEGIN; UPDATE jobs SET state = 'acked', finished_at = now(), updated_at = now(), \
             waiting = NULL WHERE id = 'race:child:c'",
        )
        .await
        .unwrap();
    JOIN_GO.notify_one();
    tokio::time::sleep(Duration::from_secs(1)).await;
    finish.batch_execute("COMMIT").await.unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            env.job("race").await.state == JobState::Acked
        })
        .await,
        "the parent is woken: {:?}",
        env.job("race").await.waiting
    );
    assert_eq!(env.job("race").await.result, Some(json!(1)));
}
