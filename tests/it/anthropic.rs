//! The Anthropic Messages API behind the same workflows: a job chooses it
//! with `"provider": "anthropic"`; the request goes to `{base}/v1/messages`
//! with `x-api-key` and `anthropic-version`; text, stop reason, usage and
//! tool calls map to the same shapes, the journal and keys are unchanged.
//! Anthropic does not de-duplicate by `Idempotency-Key`: a lost answer is
//! paid for again, and the journal still keeps one result and one delivery.

use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::{FakeConsumer, TestEnv};
use onceflow_engine::{EngineConfig, JobState, Registry};
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);

fn config(env: &TestEnv) -> EngineConfig {
    let mut config = env.config();
    config.provider.anthropic_api_key = Some("sk-ant-test".into());
    config
}

fn job(env: &TestEnv, id: &str, workflow: &str, input: Value) -> NewJob {
    NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: workflow.into(),
        workflow_version: 1,
        input,
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    }
}

#[actix_rt::test]
async fn a_completion_goes_to_the_messages_api_and_comes_back_in_the_same_shape() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(Completion::default());
    let _engine = env.start(registry, config(&env));
    env.submit_job(job(
        &env,
        "claude-1",
        "completion",
        json!({ "provider": "anthropic", "model": "claude-x", "max_tokens": 50, "messages": [
            { "role": "system", "content": "be brief" },
            { "role": "user", "content": "hello" }] }),
    ))
    .await;
    let job = env.wait_for("claude-1", JobState::Acked, WAIT).await;
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 1);
    let r = &requests[0];
    assert_eq!(r.path, "/v1/messages");
    assert_eq!(r.x_api_key.as_deref(), Some("sk-ant-test"));
    assert_eq!(r.anthropic_version.as_deref(), Some("2023-06-01"));
    assert_eq!(r.authorization, None, "no OpenAI bearer token to Anthropic");
    assert_eq!(r.idempotency_key.as_deref(), Some("job:claude-1:generate"));
    assert_eq!(r.body["system"], "be brief");
    assert_eq!(r.body["max_tokens"], 50);
    assert_eq!(
        r.body["messages"],
        json!([{ "role": "user", "content": "hello" }])
    );
    assert!(r.body.get("provider").is_none());
    let result = job.result.unwrap();
    assert_eq!(result["content"], "echo: hello (#1)");
    assert_eq!(result["finish_reason"], "stop");
    assert_eq!(job.model_calls[0].input_tokens, Some(9));
    assert_eq!(job.model_calls[0].output_tokens, Some(4));
    assert_eq!(env.consumer.processed_for("claude-1"), 1);
}

#[actix_rt::test]
async fn the_agents_tool_calls_run_once_through_tool_use_and_tool_result_blocks() {
    let env = TestEnv::new().await;
    let tickets = FakeConsumer::start();
    env.provider.respond_anthropic_with(|request, n| {
        let last = request["messages"].as_array().unwrap().last().unwrap();
        let content = if last["content"][0]["type"] == "tool_result" {
            json!([{ "type": "text", "text": format!("filed: {}", last["content"][0]["content"].as_str().unwrap()) }])
        } else {
            json!([{ "type": "tool_use", "id": "toolu_1", "name": "http_post", "input": { "title": "broken" } }])
        };
        let stop = if content[0]["type"] == "tool_use" { "tool_use" } else { "end_turn" };
        json!({ "id": format!("msg_{n}"), "type": "message", "role": "assistant", "model": "claude-x",
                "content": content, "stop_reason": stop, "usage": { "input_tokens": 5, "output_tokens": 2 } })
    });
    let mut registry = Registry::new();
    registry.register(Agent::new().with_tool(HttpPost::new(tickets.url())));
    let _engine = env.start(registry, config(&env));
    env.submit_job(job(
        &env,
        "claude-agent",
        "agent",
        json!({ "provider": "anthropic", "model": "claude-x",
                "messages": [{ "role": "user", "content": "open a ticket" }] }),
    ))
    .await;
    let job = env.wait_for("claude-agent", JobState::Acked, WAIT).await;
    assert_eq!(
        tickets.processed_with_key("job:claude-agent:tool:0:0"),
        1,
        "the tool ran once, under the ledger's key"
    );
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 2, "two turns");
    assert_eq!(requests[0].body["tools"][0]["name"], "http_post");
    assert!(requests[0].body["tools"][0]["input_schema"].is_object());
    let second = &requests[1].body["messages"];
    assert_eq!(second[1]["role"], "assistant");
    assert_eq!(second[1]["content"][0]["type"], "tool_use");
    assert_eq!(second[1]["content"][0]["id"], "toolu_1");
    assert_eq!(second[2]["content"][0]["type"], "tool_result");
    assert_eq!(second[2]["content"][0]["tool_use_id"], "toolu_1");
    assert!(job.result.unwrap()["content"]
        .as_str()
        .unwrap()
        .starts_with("filed:"));
    assert_eq!(job.tool_calls.len(), 1);
    assert_eq!(env.consumer.processed_for("claude-agent"), 1);
}

#[actix_rt::test]
async fn a_lost_answer_is_paid_for_again_but_the_journal_keeps_one_result_and_one_delivery() {
    let env = TestEnv::new().await;
    // The provider does the work, then the answer is lost on the way back.
    env.faults
        .arm_once("claude-lost", FailPoint::ModelAfterSend, Action::Fail);
    let mut registry = Registry::new();
    registry.register(Completion::default());
    let _engine = env.start(registry, config(&env));
    env.submit_job(job(
        &env,
        "claude-lost",
        "completion",
        json!({ "provider": "anthropic", "model": "claude-x",
                "messages": [{ "role": "user", "content": "hi" }] }),
    ))
    .await;
    let job = env.wait_for("claude-lost", JobState::Acked, WAIT).await;
    assert!(env.faults.fired("claude-lost"));
    let key = "job:claude-lost:generate";
    assert_eq!(
        env.provider.requests_for(key),
        2,
        "sent again under the same key"
    );
    assert_eq!(
        env.provider.work_done(key),
        2,
        "Anthropic ignores the key: the work was done (and billed) twice"
    );
    assert_eq!(job.model_calls.len(), 1, "one journaled call");
    assert_eq!(
        job.result.unwrap()["content"],
        "echo: hi (#2)",
        "the result is the answer that was journaled"
    );
    assert_eq!(env.consumer.processed_for("claude-lost"), 1);
    assert_eq!(
        env.consumer.requests_with_key("job:claude-lost:completed"),
        1
    );
}

#[actix_rt::test]
async fn an_unknown_provider_is_refused_at_intake() {
    let env = TestEnv::new().await;
    let mut registry = Registry::new();
    registry.register(Completion::default());
    let base = crate::support::serve_api(&env, registry, None);
    let (status, body) = crate::support::post_job(
        &base,
        &json!({ "id": "gem-1", "workflow": "completion", "webhook_url": env.consumer.url(),
                 "input": { "provider": "gemini", "model": "m",
                            "messages": [{ "role": "user", "content": "hi" }] } }),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["field"], "input.provider", "{body}");
}
