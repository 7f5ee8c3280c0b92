//! Agent jobs, the tool ledger, user workflows with general steps, retention.

use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::actor::Outcome;
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::store::Intake;
use onceflow_engine::testkit::{wait_until, Behaviour, FakeConsumer, TestEnv};
use onceflow_engine::{JobState, Registry};
use onceflow_workflows::example::Onboarding;
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);

/// A provider script: while the conversation has no tool answer yet, ask for
/// `calls` (id, arguments) of `http_post`; once it has, answer "done".
pub(crate) fn script_tool_calls(env: &TestEnv, calls: Vec<(&'static str, Value)>) {
    let named = calls
        .into_iter()
        .map(|(id, args)| (id, "http_post", args))
        .collect();
    script_named_calls(env, named);
}

/// As [`script_tool_calls`], each call naming its tool: (id, tool, arguments).
pub(crate) fn script_named_calls(env: &TestEnv, calls: Vec<(&'static str, &'static str, Value)>) {
    env.provider.respond_with(move |request, n| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let answered = messages.iter().any(|m| m["role"] == "tool");
        let message = if answered || calls.is_empty() {
            json!({ "role": "assistant", "content": format!("done #{n}") })
        } else {
            tool_calls_message(&calls)
        };
        chat_answer(request, n, message)
    });
}

/// An assistant message asking for `calls` (id, tool, arguments).
pub(crate) fn tool_calls_message(calls: &[(&str, &str, Value)]) -> Value {
    let tool_calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, args)| {
            json!({ "id": id, "type": "function",
                    "function": { "name": name, "arguments": args.to_string() } })
        })
        .collect();
    json!({ "role": "assistant", "content": null, "tool_calls": tool_calls })
}

/// A chat completion answering `request` (the provider's `n`-th) with `message`.
pub(crate) fn chat_answer(request: &Value, n: u64, message: Value) -> Value {
    json!({
        "id": format!("chatcmpl-{n}"), "object": "chat.completion", "model": request["model"],
        "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 5, "completion_tokens": 2 }
    })
}

fn agent_registry(tool_url: &str) -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r.register(Agent::new().with_tool(HttpPost::new(tool_url)));
    r
}

fn agent_job(env: &TestEnv, id: &str) -> NewJob {
    NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: "agent".to_owned(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "open a ticket" }] }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    }
}

fn tool_key(id: &str, turn: i32, index: i32) -> String {
    format!("job:{id}:tool:{turn}:{index}")
}

/// The tool message contents the provider was shown, per request.
pub(crate) fn tool_messages(env: &TestEnv) -> Vec<String> {
    env.provider
        .requests()
        .iter()
        .flat_map(|r| r.body["messages"].as_array().cloned().unwrap_or_default())
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[actix_rt::test]
async fn a_turn_retried_after_the_tool_ran_replays_the_stored_result() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    script_tool_calls(&env, vec![("call_1", json!({ "ticket": "A" }))]);
    env.provider.push(Behaviour::Ok); // turn 0: asks for the tool
    env.provider.push(Behaviour::Status(500, None)); // turn 1 fails once
    let config = env.config();
    let telemetry = config.telemetry.clone();
    let _engine = env.start(agent_registry(&tools.url()), config);
    env.submit_job(agent_job(&env, "agent-1")).await;
    let job = env.wait_for("agent-1", JobState::Acked, WAIT).await;
    // The node's counters agree with what the tool and the provider saw.
    let metrics = telemetry.prometheus();
    for (series, want) in [
        (
            "onceflow_tool_executions_total{onceflow_outcome=\"performed\"}",
            1,
        ),
        (
            "onceflow_tool_executions_total{onceflow_outcome=\"replayed\"}",
            1,
        ),
        (
            "onceflow_model_calls_total{onceflow_outcome=\"performed\"}",
            2,
        ),
        (
            "onceflow_model_calls_total{onceflow_outcome=\"retried\"}",
            1,
        ),
        (
            "onceflow_model_calls_total{onceflow_outcome=\"replayed\"}",
            1,
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == format!("{series} {want}")),
            "{series} {want} in:\n{metrics}"
        );
    }

    assert_eq!(
        tools.requests_with_key(&tool_key("agent-1", 0, 0)),
        1,
        "the tool ran once"
    );
    assert_eq!(tools.processed_with_key(&tool_key("agent-1", 0, 0)), 1);
    // Turn 1 was sent twice, and both times the model read the same tool result.
    let seen = tool_messages(&env);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        seen[0], seen[1],
        "the replayed call returns exactly the first result"
    );
    let stored = env
        .sql("SELECT result FROM tool_calls WHERE job_id = 'agent-1' AND turn = 0 AND call_index = 0")
        .await;
    assert_eq!(stored[0]["result"].as_str().unwrap(), seen[0]);
    assert_eq!(job.result.unwrap()["tool_calls"], 1);
    assert_eq!(env.consumer.processed_for("agent-1"), 1, "one webhook");
}

#[actix_rt::test]
async fn a_node_restarted_mid_loop_does_not_run_the_tool_again() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    script_tool_calls(&env, vec![("call_1", json!({ "ticket": "B" }))]);
    // The second model call (turn 1) is answered, then the attempt dies
    // before reading it: after the tool ran, before the next turn finished.
    env.faults
        .arm_nth("agent-2", FailPoint::ModelAfterSend, Action::Crash, 2);
    let first = env.start(agent_registry(&tools.url()), env.config());
    env.submit_job(agent_job(&env, "agent-2")).await;
    assert!(
        wait_until(WAIT, || async {
            env.provider.requests_for("job:agent-2:turn:1") == 1
        })
        .await
    );
    assert!(
        wait_until(WAIT, || async { env.faults.fired("agent-2") }).await,
        "the crash after turn 1's send fired"
    );
    first.shutdown();
    // A new node, nothing in memory: the ledger is all it has.
    let _second = env.start(agent_registry(&tools.url()), env.config());
    let job = env.wait_for("agent-2", JobState::Acked, WAIT).await;
    assert!(
        job.attempts >= 2,
        "a second attempt finished the job: {}",
        job.attempts
    );
    assert_eq!(
        tools.requests_with_key(&tool_key("agent-2", 0, 0)),
        1,
        "the tool did not run again"
    );
    assert_eq!(env.provider.work_done("job:agent-2:turn:1"), 1);
    assert_eq!(
        env.consumer.deliveries_for("agent-2").len(),
        1,
        "one webhook"
    );
}

#[actix_rt::test]
async fn the_same_call_position_with_other_arguments_fails_loudly_and_runs_nothing() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    script_tool_calls(&env, vec![("call_1", json!({ "ticket": "C" }))]);
    env.submit_job(agent_job(&env, "agent-3")).await;
    // The ledger already holds call_1 at this position, with other arguments.
    env.execute(
        "INSERT INTO tool_calls (job_id, tool_call_id, turn, call_index, tool_name, arguments_hash) \
         VALUES ('agent-3', 'call_1', 0, 0, 'http_post', repeat('0', 64))",
    )
    .await;
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    let job = env.wait_for("agent-3", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "tool_call_conflict");
    assert!(tools.deliveries().is_empty(), "no side effect");
}

#[actix_rt::test]
async fn a_reused_tool_call_id_runs_both_calls_once_each() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    script_tool_calls(
        &env,
        vec![
            ("call_same", json!({ "ticket": "D1" })),
            ("call_same", json!({ "ticket": "D2" })),
        ],
    );
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    env.submit_job(agent_job(&env, "agent-4")).await;
    let job = env.wait_for("agent-4", JobState::Acked, WAIT).await;
    assert_eq!(tools.processed_with_key(&tool_key("agent-4", 0, 0)), 1);
    assert_eq!(tools.processed_with_key(&tool_key("agent-4", 0, 1)), 1);
    assert_eq!(
        tools.deliveries().len(),
        2,
        "neither call dropped, neither repeated"
    );
    let bodies: Vec<Value> = tools.deliveries().iter().map(|d| d.body.clone()).collect();
    assert!(
        bodies.contains(&json!({ "ticket": "D1" })) && bodies.contains(&json!({ "ticket": "D2" }))
    );
    assert_eq!(job.result.unwrap()["tool_calls"], 2);
}

#[actix_rt::test]
async fn two_concurrent_executions_of_one_tool_call_have_one_side_effect() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    tools.push(Behaviour::Slow(Duration::from_millis(500)));
    script_tool_calls(&env, vec![("call_1", json!({ "ticket": "E" }))]);
    env.submit_job(agent_job(&env, "agent-5")).await;
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let reg = agent_registry(&tools.url());
    let (a, b) = tokio::join!(
        env.run_attempt(&reg, leased.clone(), env.config()),
        env.run_attempt(&reg, leased, env.config()),
    );
    assert_eq!((a, b), (Outcome::Acked, Outcome::Acked));
    assert_eq!(
        tools.requests_with_key(&tool_key("agent-5", 0, 0)),
        1,
        "one side effect"
    );
    assert_eq!(env.consumer.deliveries_for("agent-5").len(), 1);
}

#[actix_rt::test]
async fn the_agent_stops_at_its_turn_limit() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    // A model that never stops calling tools.
    env.provider.respond_with(|_, n| {
        json!({ "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null,
            "tool_calls": [{ "id": format!("c{n}"), "type": "function",
                             "function": { "name": "http_post", "arguments": "{}" } }] } }] })
    });
    let _engine = env.start(agent_registry(&tools.url()), env.config());
    let mut job = agent_job(&env, "agent-6");
    job.input["max_turns"] = json!(3);
    env.submit_job(job).await;
    let job = env.wait_for("agent-6", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "turn_limit");
    assert_eq!(env.provider.requests().len(), 3);
    assert_eq!(tools.deliveries().len(), 3);
    assert!(env.consumer.deliveries().is_empty());
}

/// The boundaries of the onboarding workflow a crash is injected at.
fn boundaries() -> Vec<FailPoint> {
    vec![
        FailPoint::ModelAfterSend,
        FailPoint::BeforeCommit("model_call"),
        FailPoint::StepAfterEffect,
        FailPoint::BeforeCommit("generated"),
        FailPoint::BeforeCommit("claimed"),
        FailPoint::AfterCommit("claimed"),
        FailPoint::WebhookAfterSend,
        // The delivery and the ack share one commit: a crash before it sends
        // again under the key; after it there is nothing left to do.
        FailPoint::BeforeCommit("acked"),
    ]
}

#[actix_rt::test]
async fn a_user_workflow_step_has_one_side_effect_across_a_crash_at_every_boundary() {
    let env = TestEnv::new().await;
    let accounts = FakeConsumer::start();
    let mut registry = Registry::new();
    registry.register(Onboarding::new(accounts.url()));
    let _engine = env.start(registry, env.config());
    for (i, point) in boundaries().into_iter().enumerate() {
        let id = format!("onboard-{i}");
        env.faults.arm_once(&id, point, Action::Crash);
        env.submit_job(NewJob {
            tags: Default::default(),
            id: id.clone(),
            workflow: "example.onboarding".to_owned(),
            workflow_version: 1,
            input: json!({ "email": format!("{id}@example.com"), "name": "Ada" }),
            webhook_url: env.consumer.url(),
            schedule: Default::default(),
        })
        .await;
        let job = env.wait_for(&id, JobState::Acked, WAIT).await;
        assert!(
            env.faults.fired(&id),
            "{point}: the crash point was reached"
        );
        assert!(job.attempts >= 2, "{point}: the crash forced a resume");
        let key = format!("job:{id}:step:create_account");
        assert_eq!(
            accounts.processed_with_key(&key),
            1,
            "{point}: the account was created once"
        );
        // Only a crash between the step's work and its journal commit repeats
        // the request (under the same key); everywhere else the journal answers.
        let expected = if point == FailPoint::StepAfterEffect {
            2
        } else {
            1
        };
        assert_eq!(accounts.requests_with_key(&key), expected, "{point}");
        assert_eq!(
            env.provider.work_done(&format!("job:{id}:welcome")),
            1,
            "{point}"
        );
        assert_eq!(env.consumer.processed_for(&id), 1, "{point}: one webhook");
        let states: Vec<JobState> = job.history.iter().map(|h| h.state).collect();
        assert_eq!(states, JobState::ALL[..6].to_vec(), "{point}");
    }
}

#[actix_rt::test]
async fn retention_purges_expired_jobs_so_their_ids_are_new_again() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.retention = Duration::from_secs(3600);
    let engine = env.start(agent_registry(&env.consumer.url()), config);
    env.submit("old-1", "hello").await;
    env.submit("recent-1", "hello").await;
    env.wait_for("old-1", JobState::Acked, WAIT).await;
    env.wait_for("recent-1", JobState::Acked, WAIT).await;
    // old-1 finished two hours ago: past the retention window.
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id = 'old-1'")
        .await;
    // Behind the node's back: its purge is armed for an hour from the
    // finish it saw, so it is told to purge now.
    engine.purge_now();
    assert!(
        wait_until(WAIT, || async {
            env.store.jobs().get("old-1").await.unwrap().is_none()
        })
        .await,
        "the supervisor purged the expired job"
    );
    let leftovers = env
        .sql(
            "SELECT (SELECT count(*) FROM job_history WHERE job_id = 'old-1') + \
                    (SELECT count(*) FROM model_calls WHERE job_id = 'old-1') + \
                    (SELECT count(*) FROM outbox WHERE job_id = 'old-1') AS n",
        )
        .await;
    assert_eq!(leftovers[0]["n"], 0, "keys and ledgers went with it");
    let different = |id: &str| NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: "completion".to_owned(),
        workflow_version: 1,
        input: json!({ "model": "other", "messages": [{ "role": "user", "content": "again" }] }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    };
    assert!(matches!(
        env.store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(&different(
                "old-1"
            )))
            .await
            .unwrap()
            .intake,
        Intake::Created(_)
    ));
    assert!(matches!(
        env.store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(&different(
                "recent-1"
            )))
            .await
            .unwrap()
            .intake,
        Intake::Conflict(_)
    ));
    assert_eq!(env.job("recent-1").await.state, JobState::Acked);
}

/// A second tool that the newer nodes of a rolling deploy have.
struct Lookup;

impl onceflow_workflows::Tool for Lookup {
    fn name(&self) -> &str {
        "lookup"
    }
    fn description(&self) -> &str {
        "looks a ticket up"
    }
    fn parameters(&self) -> Value {
        json!({ "type": "object", "properties": { "ticket": { "type": "string" } } })
    }
    fn execute(
        &self,
        _: onceflow_engine::context::ToolInvocation,
        _: Value,
    ) -> futures_util::future::BoxFuture<'_, Result<String, onceflow_engine::StepError>> {
        Box::pin(async { Ok("found".to_owned()) })
    }
}

/// The tools each of the provider's requests for `key` offered, by name.
fn offered(env: &TestEnv, key: &str) -> Vec<Vec<String>> {
    env.provider
        .requests()
        .iter()
        .filter(|r| r.idempotency_key.as_deref() == Some(key))
        .map(|r| {
            r.body["tools"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                .collect()
        })
        .collect()
}

/// An agent job's tool set is pinned in its journal: started on a node
/// with one tool and resumed, mid-turn, on a node with two (a deploy half
/// rolled out), the job asks the model with the first node's list again
/// (the turn's key keeps its hash, so no `model_key_conflict`), its tool
/// runs once, one webhook. And a node that lacks a tool the job's list has
/// retries the job for another node instead of killing it.
#[actix_rt::test]
async fn an_agent_job_keeps_its_tool_set_across_nodes_that_differ() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    script_tool_calls(&env, vec![("call_1", json!({ "ticket": "T" }))]);
    // The crashed attempt's lease outlives the shutdown below by far, so
    // the old node never takes the job up again itself.
    let old_config = || {
        let mut c = env.config();
        c.lease = Duration::from_secs(5);
        c
    };
    env.faults
        .arm_nth("agent-pin", FailPoint::ModelAfterSend, Action::Crash, 1);
    let old = env.start(agent_registry(&tools.url()), old_config());
    env.submit_job(agent_job(&env, "agent-pin")).await;
    assert!(
        wait_until(WAIT, || async { env.faults.fired("agent-pin") }).await,
        "the crash after turn 0's send fired"
    );
    old.shutdown();
    let mut newer = Registry::new();
    newer.register(
        Agent::new()
            .with_tool(HttpPost::new(tools.url()))
            .with_tool(Lookup),
    );
    let new = env.start(newer, env.config());
    let job = env.wait_for("agent-pin", JobState::Acked, WAIT).await;
    assert!(job.attempts >= 2, "resumed by the newer node");
    let turn0 = offered(&env, "job:agent-pin:turn:0");
    assert_eq!(turn0.len(), 2, "sent, crashed, sent again: {turn0:?}");
    assert!(
        turn0.iter().all(|t| t == &vec!["http_post".to_owned()]),
        "{turn0:?}"
    );
    assert_eq!(env.provider.work_done("job:agent-pin:turn:0"), 1);
    assert_eq!(tools.requests_with_key(&tool_key("agent-pin", 0, 0)), 1);
    assert_eq!(env.consumer.deliveries_for("agent-pin").len(), 1);
    new.shutdown();

    // Pinned with http_post, resumed where only `lookup` exists: retried.
    env.faults
        .arm_nth("agent-gone", FailPoint::ModelAfterSend, Action::Crash, 1);
    let old = env.start(agent_registry(&tools.url()), old_config());
    env.submit_job(agent_job(&env, "agent-gone")).await;
    assert!(wait_until(WAIT, || async { env.faults.fired("agent-gone") }).await);
    old.shutdown();
    let mut lacking = Registry::new();
    lacking.register(Agent::new().with_tool(Lookup));
    let lacking = env.start(lacking, env.config());
    assert!(
        wait_until(WAIT, || async {
            env.job("agent-gone")
                .await
                .last_error
                .is_some_and(|e| e.code == "tool_unavailable")
        })
        .await,
        "the node without the tool retries the job: {:?}",
        env.job("agent-gone").await
    );
    assert_eq!(env.job("agent-gone").await.state, JobState::Received);
    lacking.shutdown();
    let _back = env.start(agent_registry(&tools.url()), env.config());
    env.wait_for("agent-gone", JobState::Acked, Duration::from_secs(60))
        .await;
    assert_eq!(tools.requests_with_key(&tool_key("agent-gone", 0, 0)), 1);
    assert_eq!(env.consumer.deliveries_for("agent-gone").len(), 1);
}
