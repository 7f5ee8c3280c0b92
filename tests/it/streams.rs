//! Durable streaming: a job with `"stream": true` journals its answer's
//! chunks as they arrive, and `GET /v1/jobs/{id}/events` shows watchers only
//! what is journaled. These tests record the decision for a stream that
//! fails halfway (docs/guide/streaming.md, LIFECYCLE.md): the next attempt asks
//! again under the same key; a provider that replays the answer is checked
//! against what was shown and the stream continues after it (no repeat, no
//! reset); one that answers differently gets exactly one `reset` and the
//! new answer, and the journal keeps both. Each case counts provider
//! requests, chunks shown and deliveries.

use std::time::Duration;

use onceflow_engine::testkit::{FakeConsumer, TestEnv};
use onceflow_engine::Registry;
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde_json::{json, Value};

use crate::support::{post_job, serve_api, ServeProcess};

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

fn streamed_job(id: &str, hook: &str) -> Value {
    json!({
        "id": id,
        "workflow": "completion",
        "input": {
            "model": "test-model",
            "stream": true,
            "messages": [{ "role": "user", "content": "tell me" }]
        },
        "webhook_url": hook,
    })
}

/// One server-sent event as a watcher got it.
#[derive(Debug, Clone)]
struct Seen {
    id: i64,
    kind: String,
    data: Value,
}

/// Reads `GET {base}/v1/jobs/{id}/events` (after `last`, when given) until
/// the server ends it, or until `stop` says so; returns every event.
async fn watch(
    base: &str,
    id: &str,
    last: Option<i64>,
    stop: impl Fn(&[Seen]) -> bool,
) -> Vec<Seen> {
    let mut request = reqwest::Client::new().get(format!("{base}/v1/jobs/{id}/events"));
    if let Some(last) = last {
        request = request.header("last-event-id", last.to_string());
    }
    let mut response = request.send().await.expect("GET events");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let (mut buffer, mut seen) = (String::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .expect("the event stream went quiet for a minute");
        let Some(chunk) = chunk.expect("reading events") else {
            return seen;
        };
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let (mut ev_id, mut kind, mut data) = (None, None, None);
            for line in frame.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    ev_id = Some(v.parse::<i64>().unwrap());
                } else if let Some(v) = line.strip_prefix("event: ") {
                    kind = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str::<Value>(v).unwrap());
                }
            }
            if let (Some(id), Some(kind), Some(data)) = (ev_id, kind, data) {
                seen.push(Seen { id, kind, data });
                if stop(&seen) {
                    return seen;
                }
            }
        }
    }
}

fn until_finished(_: &[Seen]) -> bool {
    false
}

/// The chunks' text, in the order shown.
fn shown(seen: &[Seen]) -> Vec<String> {
    seen.iter()
        .filter(|s| s.kind == "chunk")
        .map(|s| s.data["text"].as_str().unwrap().to_owned())
        .collect()
}

/// What a watcher ends up displaying: the chunks since the last reset.
fn displayed(seen: &[Seen]) -> String {
    let from = seen
        .iter()
        .rposition(|s| s.kind == "reset")
        .map_or(0, |i| i + 1);
    shown(&seen[from..]).concat()
}

fn assert_ids_increase(seen: &[Seen]) {
    for pair in seen.windows(2) {
        assert!(pair[0].id < pair[1].id, "ids increase: {seen:?}");
    }
}

async fn result_content(env: &TestEnv, id: &str) -> String {
    let rows = env
        .sql(&format!(
            "SELECT output->>'content' AS c FROM results WHERE job_id = '{id}'"
        ))
        .await;
    rows[0]["c"].as_str().unwrap().to_owned()
}

async fn journal(env: &TestEnv, id: &str) -> Vec<(i64, i64, String)> {
    env.sql(&format!(
        "SELECT generation AS g, \"offset\" AS o, kind FROM stream_events \
         WHERE job_id = '{id}' ORDER BY id"
    ))
    .await
    .as_array()
    .unwrap()
    .iter()
    .map(|r| {
        (
            r["g"].as_i64().unwrap(),
            r["o"].as_i64().unwrap(),
            r["kind"].as_str().unwrap().to_owned(),
        )
    })
    .collect()
}

/// A clean stream: two watchers from the start see the same events, every
/// chunk once, in order, then the final state; the result is what they saw.
#[actix_rt::test]
async fn a_clean_stream_is_shown_once_to_every_watcher_and_is_the_result() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(40));
    let base = serve_api(&env, registry(), None);
    let (status, body) = post_job(&base, &streamed_job("s-clean", &env.consumer.url())).await;
    assert_eq!(status, 201, "{body}");
    let _engine = env.start(registry(), env.config());
    let (a, b) = tokio::join!(
        watch(&base, "s-clean", None, until_finished),
        watch(&base, "s-clean", None, until_finished),
    );
    let content = result_content(&env, "s-clean").await;
    for seen in [&a, &b] {
        assert_ids_increase(seen);
        assert_eq!(shown(seen).len(), 8, "every chunk shown once: {seen:?}");
        assert_eq!(shown(seen).concat(), content);
        assert!(seen.iter().all(|s| s.kind != "reset"));
        let last = seen.last().unwrap();
        assert_eq!(
            (last.kind.as_str(), last.data["text"].as_str()),
            ("state", Some("acked"))
        );
    }
    assert_eq!(
        a.iter().map(|s| s.id).collect::<Vec<_>>(),
        b.iter().map(|s| s.id).collect::<Vec<_>>(),
        "both watchers saw the same events"
    );
    assert_eq!(env.provider.stream_requests(), 1);
    assert_eq!(env.provider.chunks_streamed(), 8);
    assert_eq!(env.provider.work_done("job:s-clean:generate"), 1);
    assert_eq!(env.consumer.deliveries_for("s-clean").len(), 1);
    let delivered = &env.consumer.deliveries_for("s-clean")[0];
    assert_eq!(
        delivered.body["data"]["result"]["content"].as_str(),
        Some(content.as_str())
    );
}

/// The connection drops after 3 of 8 chunks and the provider replays by
/// key: the next attempt's stream repeats the 3 (checked, not journaled
/// again) and the watcher sees the 5 after them — no repeat, no reset —
/// for one unit of the provider's work and one delivery.
#[actix_rt::test]
async fn a_lost_connection_with_a_replaying_provider_continues_without_repeat() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(20));
    env.provider.drop_stream_after(3);
    let base = serve_api(&env, registry(), None);
    let (status, _) = post_job(&base, &streamed_job("s-replay", &env.consumer.url())).await;
    assert_eq!(status, 201);
    let _engine = env.start(registry(), env.config());
    let seen = watch(&base, "s-replay", None, until_finished).await;
    assert_ids_increase(&seen);
    let content = result_content(&env, "s-replay").await;
    assert_eq!(
        shown(&seen).len(),
        8,
        "8 chunks shown, none twice: {seen:?}"
    );
    assert_eq!(shown(&seen).concat(), content);
    assert!(seen.iter().all(|s| s.kind != "reset"), "no reset: {seen:?}");
    assert_eq!(
        env.provider.stream_requests(),
        2,
        "asked again under the same key"
    );
    assert_eq!(
        env.provider.work_done("job:s-replay:generate"),
        1,
        "the provider replayed: paid once"
    );
    assert_eq!(env.provider.chunks_streamed(), 3 + 8);
    assert_eq!(env.consumer.deliveries_for("s-replay").len(), 1);
    let generations: Vec<i64> = journal(&env, "s-replay")
        .await
        .iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(generations, vec![1; 8], "one generation of 8 chunks");
}

/// The connection drops after 3 chunks and the provider answers the repeat
/// differently (it does not replay by key): watchers see exactly one
/// `reset`, then the new answer, which is the result; the journal keeps
/// both generations; the provider worked twice; one delivery.
#[actix_rt::test]
async fn a_lost_connection_with_a_new_answer_resets_once_and_keeps_both() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(20));
    env.provider.set_stream_replay(false);
    env.provider.drop_stream_after(3);
    let base = serve_api(&env, registry(), None);
    let (status, _) = post_job(&base, &streamed_job("s-new", &env.consumer.url())).await;
    assert_eq!(status, 201);
    let _engine = env.start(registry(), env.config());
    let seen = watch(&base, "s-new", None, until_finished).await;
    assert_ids_increase(&seen);
    let resets: Vec<&Seen> = seen.iter().filter(|s| s.kind == "reset").collect();
    assert_eq!(resets.len(), 1, "exactly one reset: {seen:?}");
    assert_eq!(resets[0].data["generation"], 2);
    assert!(resets[0].data["text"].as_str().unwrap().contains("differs"));
    let content = result_content(&env, "s-new").await;
    assert_eq!(displayed(&seen), content, "after the reset, the new answer");
    let before: Vec<&Seen> = seen
        .iter()
        .take_while(|s| s.kind != "reset")
        .filter(|s| s.kind == "chunk")
        .collect();
    assert_eq!(before.len(), 3, "the first answer's 3 chunks, shown once");
    assert_eq!(env.provider.stream_requests(), 2);
    assert_eq!(
        env.provider.work_done("job:s-new:generate"),
        2,
        "no replay: paid twice"
    );
    assert_eq!(env.consumer.deliveries_for("s-new").len(), 1);
    let kept = journal(&env, "s-new").await;
    assert_eq!(
        kept.iter().filter(|r| r.0 == 1).count(),
        3,
        "generation 1 kept: {kept:?}"
    );
    assert!(kept.contains(&(2, -1, "reset".into())));
}

/// A watcher that leaves after 3 chunks and comes back with
/// `Last-Event-ID` gets exactly the rest: together, every event once, no
/// gap, no repeat. One that connects after the job finished gets the whole
/// journaled stream and the final state.
#[actix_rt::test]
async fn last_event_id_resumes_exactly_and_a_late_watcher_gets_everything() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(60));
    let base = serve_api(&env, registry(), None);
    let (status, _) = post_job(&base, &streamed_job("s-resume", &env.consumer.url())).await;
    assert_eq!(status, 201);
    let _engine = env.start(registry(), env.config());
    let first = watch(&base, "s-resume", None, |seen| shown(seen).len() == 3).await;
    let last = first.last().unwrap().id;
    assert!(
        !env.job("s-resume").await.state.is_terminal(),
        "the watcher left mid-stream"
    );
    let rest = watch(&base, "s-resume", Some(last), until_finished).await;
    assert!(
        rest.iter().all(|s| s.id > last),
        "nothing before Last-Event-ID"
    );
    let together: Vec<Seen> = first.iter().chain(rest.iter()).cloned().collect();
    assert_ids_increase(&together);
    let content = result_content(&env, "s-resume").await;
    assert_eq!(shown(&together).len(), 8);
    assert_eq!(shown(&together).concat(), content);

    let late = watch(&base, "s-resume", None, until_finished).await;
    assert_eq!(
        late.iter().map(|s| s.id).collect::<Vec<_>>(),
        together.iter().map(|s| s.id).collect::<Vec<_>>(),
        "a late watcher gets the same events from the journal"
    );
    assert_eq!(late.last().unwrap().data["text"], "acked");
    // Past the end of a finished job: 204, which tells an EventSource to
    // stop reconnecting.
    let past = reqwest::Client::new()
        .get(format!("{base}/v1/jobs/s-resume/events"))
        .header("last-event-id", late.last().unwrap().id.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(past.status(), 204);
    assert!(past.bytes().await.unwrap().is_empty());
    // One event before the end: that event, then the stream ends.
    let before_end = late[late.len() - 2].id;
    let tail = watch(&base, "s-resume", Some(before_end), until_finished).await;
    assert_eq!(
        tail.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![late.last().unwrap().id]
    );
    assert_eq!(env.provider.stream_requests(), 1);
    assert_eq!(env.consumer.deliveries_for("s-resume").len(), 1);
}

/// A bad `Last-Event-ID` is a 400 naming the header; an unknown job a 404.
#[actix_rt::test]
async fn bad_event_requests_get_clear_errors() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, registry(), None);
    let (status, _) = post_job(&base, &streamed_job("s-bad", &env.consumer.url())).await;
    assert_eq!(status, 201);
    let client = reqwest::Client::new();
    let r = client
        .get(format!("{base}/v1/jobs/s-bad/events"))
        .header("last-event-id", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["field"], "Last-Event-ID", "{body}");
    let r = client
        .get(format!("{base}/v1/jobs/nobody/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // `stream` is a boolean, checked at intake; nothing is stored.
    let mut job = streamed_job("s-yes", &env.consumer.url());
    job["input"]["stream"] = json!("yes");
    let (status, body) = post_job(&base, &job).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["field"], "input.stream", "{body}");
    let stored = env.sql("SELECT id FROM jobs WHERE id = 's-yes'").await;
    assert_eq!(stored.as_array().unwrap().len(), 0);
}

/// `kill -9` of the `serve` process mid-stream (after 3 of 8 chunks were
/// shown); another node resumes the job: it asks again under the same key,
/// the replaying provider repeats the answer, and a watcher on that node
/// sees the 8 chunks once each, no reset; one unit of work, one delivery.
#[actix_rt::test]
async fn a_killed_node_mid_stream_is_resumed_by_another_without_repeat() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(300));
    let dir = tempfile::tempdir().unwrap();
    let vars = vec![
        ("DATABASE_URL", env.db_url.clone()),
        ("OPENAI_BASE_URL", env.provider.base_url()),
        ("ONCEFLOW_LEASE_MS", "2000".to_owned()),
        ("ONCEFLOW_POLL_MS", "200".to_owned()),
        ("ONCEFLOW_NODE_ID", "doomed".to_owned()),
    ];
    let mut doomed = ServeProcess::start(&vars, &dir.path().join("doomed.log")).await;
    let (status, body) = post_job(&doomed.base, &streamed_job("s-kill", &env.consumer.url())).await;
    assert_eq!(status, 201, "{body}");
    let before = watch(&doomed.base, "s-kill", None, |seen| shown(seen).len() == 3).await;
    doomed.sigkill();
    assert_eq!(env.provider.stream_requests(), 1);
    // Another node, in this process, with its own API.
    let base = serve_api(&env, registry(), None);
    let mut config = env.config();
    config.node_id = "survivor".into();
    let _survivor = env.start(registry(), config);
    let seen = watch(&base, "s-kill", None, until_finished).await;
    assert_ids_increase(&seen);
    assert_eq!(
        seen.iter()
            .take(before.len())
            .map(|s| s.id)
            .collect::<Vec<_>>(),
        before.iter().map(|s| s.id).collect::<Vec<_>>(),
        "what the first watcher saw is a prefix of the journal"
    );
    let content = result_content(&env, "s-kill").await;
    assert_eq!(shown(&seen).len(), 8, "{seen:?}");
    assert_eq!(shown(&seen).concat(), content);
    assert!(seen.iter().all(|s| s.kind != "reset"));
    assert_eq!(env.provider.stream_requests(), 2);
    assert_eq!(env.provider.work_done("job:s-kill:generate"), 1);
    assert_eq!(env.consumer.deliveries_for("s-kill").len(), 1);
    let worker = env
        .sql("SELECT worker FROM job_history WHERE job_id = 's-kill' AND state = 'generated'")
        .await;
    assert_eq!(worker[0]["worker"], "survivor");
}

/// `onceflow watch ID` prints the streamed answer as it comes, once, and
/// exits 0 when the job is acked; its stdout is exactly the result.
#[actix_rt::test]
async fn the_watch_command_prints_the_answer_once() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(50));
    env.provider.drop_stream_after(4);
    let base = serve_api(&env, registry(), None);
    let (status, _) = post_job(&base, &streamed_job("s-cli", &env.consumer.url())).await;
    assert_eq!(status, 201);
    let watcher = {
        let base = base.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"))
                .args(["watch", "s-cli", "--server", &base])
                .output()
                .unwrap()
        })
    };
    let _engine = env.start(registry(), env.config());
    let out = watcher.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let content = result_content(&env, "s-cli").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{content}\n"));
    assert!(stderr.contains("[acked]"), "{stderr}");
    assert_eq!(env.provider.stream_requests(), 2, "the stream broke once");
}

/// The agent's final answer, streamed: its first turn streams a tool call
/// (no text), broken after its head and half its arguments; the repeat under
/// the same key completes it, and the tool runs once with the whole
/// arguments. The final turn streams its answer, broken after 3 of 9
/// chunks; the watcher sees the 9 once each under the final turn's key, no
/// reset. Each turn paid once, one delivery.
#[actix_rt::test]
async fn the_agents_final_answer_streams_and_a_broken_turn_repeats_nothing() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(20));
    const ANSWER: &str = "ticket A is open and waiting for you now";
    env.provider.respond_with(|request, _| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let message = if messages.iter().any(|m| m["role"] == "tool") {
            json!({ "role": "assistant", "content": ANSWER })
        } else {
            json!({ "role": "assistant", "content": null, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": { "name": "http_post", "arguments": "{\"ticket\":\"A\"}" }
            }] })
        };
        json!({ "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }] })
    });
    // Turn 0 breaks mid-arguments, its repeat goes whole; turn 1 breaks
    // after 3 chunks, its repeat goes whole.
    env.provider.drop_stream_after(2);
    env.provider.stream_whole();
    env.provider.drop_stream_after(3);
    let tools = FakeConsumer::start();
    let agent = |url: String| {
        let mut r = Registry::new();
        r.register(Agent::new().with_tool(HttpPost::new(url)));
        r
    };
    let base = serve_api(&env, agent(tools.url()), None);
    let job = json!({
        "id": "s-agent",
        "workflow": "agent",
        "input": {
            "model": "test-model",
            "stream": true,
            "messages": [{ "role": "user", "content": "open a ticket" }]
        },
        "webhook_url": env.consumer.url(),
    });
    let (status, body) = post_job(&base, &job).await;
    assert_eq!(status, 201, "{body}");
    let _engine = env.start(agent(tools.url()), env.config());
    let seen = watch(&base, "s-agent", None, until_finished).await;
    assert_ids_increase(&seen);
    let chunks: Vec<&Seen> = seen.iter().filter(|s| s.kind == "chunk").collect();
    assert_eq!(chunks.len(), 9, "9 chunks shown, none twice: {seen:?}");
    assert!(
        chunks
            .iter()
            .all(|c| c.data["call"] == "job:s-agent:turn:1"),
        "only the final turn has text: {seen:?}"
    );
    assert!(seen.iter().all(|s| s.kind != "reset"), "no reset: {seen:?}");
    assert_eq!(shown(&seen).concat(), ANSWER);
    assert_eq!(result_content(&env, "s-agent").await, ANSWER);
    assert_eq!(env.provider.stream_requests(), 4, "each turn asked twice");
    assert_eq!(
        env.provider.chunks_streamed(),
        3 + 9,
        "the final answer broke after 3 chunks, then came whole"
    );
    assert_eq!(env.provider.work_done("job:s-agent:turn:0"), 1);
    assert_eq!(env.provider.work_done("job:s-agent:turn:1"), 1);
    let effects = tools.deliveries();
    assert_eq!(effects.len(), 1, "the tool ran once: {effects:?}");
    assert_eq!(
        effects[0].idempotency_key.as_deref(),
        Some("job:s-agent:tool:0:0")
    );
    assert!(
        effects[0].body.to_string().contains("\"ticket\":\"A\""),
        "with its whole arguments: {}",
        effects[0].body
    );
    assert_eq!(env.consumer.deliveries_for("s-agent").len(), 1);
    let delivered = &env.consumer.deliveries_for("s-agent")[0];
    assert_eq!(delivered.body["data"]["result"]["content"], ANSWER);
    assert_eq!(delivered.body["data"]["result"]["tool_calls"], 1);
    // The tool call showed on the stream: started, then finished; the
    // attempt after the broken final turn took its journaled result,
    // shown as replayed (it did not run again).
    assert_eq!(
        tool_events(&seen),
        [
            ("job:s-agent:tool:0:0".to_owned(), "started".to_owned()),
            ("job:s-agent:tool:0:0".to_owned(), "finished".to_owned()),
            ("job:s-agent:tool:0:0".to_owned(), "replayed".to_owned()),
        ]
    );
    let tool = seen.iter().find(|s| s.kind == "tool").unwrap();
    assert_eq!(
        (
            tool.data["tool"]["name"].as_str(),
            tool.data["tool"]["tool_call_id"].as_str()
        ),
        (Some("http_post"), Some("call_1"))
    );
    let finished = seen
        .iter()
        .position(|s| s.kind == "tool" && s.data["text"] == "finished")
        .unwrap();
    let first_chunk = seen.iter().position(|s| s.kind == "chunk").unwrap();
    assert!(finished < first_chunk, "{seen:?}");
}

/// The tool events a watcher saw: (call, phase), in order.
fn tool_events(seen: &[Seen]) -> Vec<(String, String)> {
    seen.iter()
        .filter(|s| s.kind == "tool")
        .map(|s| {
            (
                s.data["call"].as_str().unwrap_or_default().to_owned(),
                s.data["text"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A crash after the tool ran (just after the next turn's request is
/// sent): the rerun takes the tool's journaled result, and watchers see
/// it as `replayed`, not as a second start; the tool ran once.
#[actix_rt::test]
async fn a_rerun_shows_a_journaled_tool_call_as_replayed() {
    use onceflow_engine::faults::{Action, FailPoint};
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(4, Duration::from_millis(10));
    env.provider.respond_with(|request, _| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let message = if messages.iter().any(|m| m["role"] == "tool") {
            json!({ "role": "assistant", "content": "done and done" })
        } else {
            json!({ "role": "assistant", "content": null, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": { "name": "http_post", "arguments": "{\"ticket\":\"B\"}" }
            }] })
        };
        json!({ "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }] })
    });
    env.faults
        .arm_nth("s-replayed", FailPoint::ModelAfterSend, Action::Crash, 2);
    let tools = FakeConsumer::start();
    let agent = |url: String| {
        let mut r = Registry::new();
        r.register(Agent::new().with_tool(HttpPost::new(url)));
        r
    };
    let base = serve_api(&env, agent(tools.url()), None);
    let job = json!({
        "id": "s-replayed",
        "workflow": "agent",
        "input": {
            "model": "test-model",
            "stream": true,
            "messages": [{ "role": "user", "content": "open a ticket" }]
        },
        "webhook_url": env.consumer.url(),
    });
    assert_eq!(post_job(&base, &job).await.0, 201);
    let _engine = env.start(agent(tools.url()), env.config());
    let seen = watch(&base, "s-replayed", None, until_finished).await;
    assert!(
        env.faults.fired_at("s-replayed", FailPoint::ModelAfterSend),
        "the crash fired"
    );
    let call = "job:s-replayed:tool:0:0".to_owned();
    assert_eq!(
        tool_events(&seen),
        [
            (call.clone(), "started".to_owned()),
            (call.clone(), "finished".to_owned()),
            (call, "replayed".to_owned()),
        ],
        "{seen:?}"
    );
    assert_eq!(shown(&seen).concat(), "done and done");
    assert_eq!(tools.deliveries().len(), 1, "the tool ran once");
    assert_eq!(env.consumer.deliveries_for("s-replayed").len(), 1);
}

fn anthropic_config(env: &TestEnv) -> onceflow_engine::EngineConfig {
    let mut config = env.config();
    config.provider.anthropic_api_key = Some("sk-ant-test".into());
    config
}

/// Anthropic streams through the same events and the same decision for a
/// stream broken halfway. Anthropic does not replay by key, so the repeat
/// is a new answer: watchers see the first answer's 3 chunks, exactly one
/// `reset`, then the new answer, which is the result; the provider worked
/// twice; one delivery. Each request is a streamed Messages request.
#[actix_rt::test]
async fn an_anthropic_stream_broken_halfway_resets_once_and_is_delivered_once() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(20));
    env.provider.drop_stream_after(3);
    let base = serve_api(&env, registry(), None);
    let mut job = streamed_job("s-claude", &env.consumer.url());
    job["input"]["provider"] = json!("anthropic");
    job["input"]["model"] = json!("claude-x");
    let (status, body) = post_job(&base, &job).await;
    assert_eq!(status, 201, "{body}");
    let _engine = env.start(registry(), anthropic_config(&env));
    let seen = watch(&base, "s-claude", None, until_finished).await;
    assert_ids_increase(&seen);
    let resets: Vec<&Seen> = seen.iter().filter(|s| s.kind == "reset").collect();
    assert_eq!(resets.len(), 1, "exactly one reset: {seen:?}");
    let before = seen
        .iter()
        .take_while(|s| s.kind != "reset")
        .filter(|s| s.kind == "chunk")
        .count();
    assert_eq!(before, 3, "the first answer's 3 chunks, shown once");
    let content = result_content(&env, "s-claude").await;
    assert_eq!(displayed(&seen), content, "after the reset, the new answer");
    assert_eq!(shown(&seen).len(), 3 + 8);
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 2, "asked again under the same key");
    for r in &requests {
        assert_eq!(r.path, "/v1/messages");
        assert_eq!(r.body["stream"], true);
        assert_eq!(r.x_api_key.as_deref(), Some("sk-ant-test"));
        assert_eq!(r.idempotency_key.as_deref(), Some("job:s-claude:generate"));
    }
    assert_eq!(env.provider.work_done("job:s-claude:generate"), 2);
    assert_eq!(env.consumer.deliveries_for("s-claude").len(), 1);
    let usage = env
        .sql("SELECT input_tokens AS i, output_tokens AS o FROM model_calls WHERE job_id = 's-claude'")
        .await;
    assert_eq!(
        (usage[0]["i"].as_i64(), usage[0]["o"].as_i64()),
        (Some(7), Some(8)),
        "the usage of message_start and message_delta: {usage}"
    );
}

/// The streamed agent on Anthropic: a turn's `tool_use` block arrives as
/// `input_json_delta` pieces; a stream broken mid-arguments runs no tool,
/// the repeat (a new answer: paid twice) runs it once with its whole
/// arguments, and the final answer streams as text.
#[actix_rt::test]
async fn the_streamed_agent_on_anthropic_runs_each_tool_call_once() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(20));
    const ANSWER: &str = "ticket A is open and waiting for you now";
    env.provider.respond_anthropic_with(|request, n| {
        let last = request["messages"].as_array().unwrap().last().unwrap();
        let (content, stop) = if last["content"][0]["type"] == "tool_result" {
            (json!([{ "type": "text", "text": ANSWER }]), "end_turn")
        } else {
            (
                json!([{ "type": "tool_use", "id": "toolu_1", "name": "http_post",
                         "input": { "ticket": "A" } }]),
                "tool_use",
            )
        };
        json!({ "id": format!("msg_{n}"), "type": "message", "role": "assistant",
                "model": "claude-x", "content": content, "stop_reason": stop,
                "usage": { "input_tokens": 5, "output_tokens": 2 } })
    });
    // Turn 0 breaks after its tool's head and first piece of arguments.
    env.provider.drop_stream_after(2);
    let tools = FakeConsumer::start();
    let agent = |url: String| {
        let mut r = Registry::new();
        r.register(Agent::new().with_tool(HttpPost::new(url)));
        r
    };
    let base = serve_api(&env, agent(tools.url()), None);
    let job = json!({
        "id": "s-claude-agent",
        "workflow": "agent",
        "input": {
            "model": "claude-x", "provider": "anthropic", "stream": true,
            "messages": [{ "role": "user", "content": "open a ticket" }]
        },
        "webhook_url": env.consumer.url(),
    });
    let (status, body) = post_job(&base, &job).await;
    assert_eq!(status, 201, "{body}");
    let _engine = env.start(agent(tools.url()), anthropic_config(&env));
    let seen = watch(&base, "s-claude-agent", None, until_finished).await;
    assert_eq!(shown(&seen).concat(), ANSWER, "{seen:?}");
    assert!(
        seen.iter().all(|s| s.kind != "reset"),
        "no text was shown before the break: {seen:?}"
    );
    assert_eq!(result_content(&env, "s-claude-agent").await, ANSWER);
    assert_eq!(env.provider.work_done("job:s-claude-agent:turn:0"), 2);
    assert_eq!(env.provider.work_done("job:s-claude-agent:turn:1"), 1);
    let effects = tools.deliveries();
    assert_eq!(effects.len(), 1, "the tool ran once: {effects:?}");
    assert_eq!(
        effects[0].idempotency_key.as_deref(),
        Some("job:s-claude-agent:tool:0:0")
    );
    assert!(
        effects[0].body.to_string().contains("\"ticket\":\"A\""),
        "with its whole arguments: {}",
        effects[0].body
    );
    let second = &env.provider.requests()[2].body["messages"];
    assert_eq!(second[1]["content"][0]["type"], "tool_use", "{second}");
    assert_eq!(second[1]["content"][0]["input"], json!({ "ticket": "A" }));
    assert_eq!(env.consumer.deliveries_for("s-claude-agent").len(), 1);
}

/// An idle stream reads nothing from the database (it used to read four
/// times a second), and a transition made anywhere reaches it through the
/// database's `NOTIFY` (here a cancel, made through another store handle as
/// another node would): the watcher gets the final state and the stream
/// ends, its row gone.
#[actix_rt::test]
async fn an_idle_stream_reads_nothing_and_a_transition_wakes_it() {
    let env = TestEnv::new().await;
    let _node = env.start(registry(), env.config()); // its LISTEN hears the NOTIFY
    let base = serve_api(&env, registry(), None);
    let mut job = streamed_job("idle-1", &env.consumer.url());
    job["delay_ms"] = json!(3_600_000); // waits, idle, for the whole test
    assert_eq!(post_job(&base, &job).await.0, 201);
    let b = base.clone();
    let watcher = actix_rt::spawn(async move { watch(&b, "idle-1", None, until_finished).await });
    let followed = || async {
        env.sql("SELECT count(*) AS n FROM stream_watchers WHERE job_id = 'idle-1'")
            .await[0]["n"]
            .as_i64()
            .unwrap()
    };
    assert!(
        onceflow_engine::testkit::wait_until(Duration::from_secs(10), || async {
            followed().await == 1
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await; // its first read done
    let reads = env.store.event_reads();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        env.store.event_reads() - reads,
        0,
        "an idle stream read the journal"
    );
    let other_node =
        onceflow_engine::Store::new(onceflow_engine::Db::connect(&env.db_url, 1).await.unwrap());
    other_node
        .jobs()
        .cancel("idle-1", "test", "done waiting")
        .await
        .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(10), watcher)
        .await
        .expect("the cancel reached the watcher without polling")
        .unwrap();
    let last = seen.last().expect("events");
    assert_eq!(
        (last.kind.as_str(), &last.data["text"]),
        ("state", &json!("cancelled")),
        "{seen:?}"
    );
    assert!(
        onceflow_engine::testkit::wait_until(Duration::from_secs(10), || async {
            followed().await == 0
        })
        .await
    );
}
