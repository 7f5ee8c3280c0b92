//! Safe to expose: the SSRF guard (at intake, at send time, no redirects),
//! nothing internal reflected, bounded answers, JSON-only and Host-checked
//! requests, strict JSON at intake.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::api::{ApiState, Hosts, DEFAULT_BODY_LIMIT};
use onceflow_engine::intake::NewJob;
use onceflow_engine::testkit::{Behaviour, FakeConsumer, TestEnv};
use onceflow_engine::{JobState, Registry, UrlGuard};
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde_json::{json, Value};

use crate::support::{client, serve_api_for, serve_api_state, ServeProcess};

const WAIT: Duration = Duration::from_secs(20);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

fn api(env: &TestEnv, guard: UrlGuard, hosts: Hosts) -> String {
    serve_api_state(ApiState {
        store: env.store.clone(),
        registry: registry(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: guard,
        hosts,
    })
}

fn job_body(id: &str, webhook_url: &str) -> Value {
    json!({
        "id": id, "workflow": "completion", "webhook_url": webhook_url,
        "input": { "model": "m", "messages": [{ "role": "user", "content": "hi" }] },
    })
}

async fn post(base: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
    let r = client()
        .post(format!("{base}/v1/jobs"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn post_json(base: &str, body: &Value) -> (u16, Value) {
    post(base, "application/json", serde_json::to_vec(body).unwrap()).await
}

/// Every spelling of an internal address is a `422` naming `webhook_url`,
/// and nothing is stored; a public URL is accepted (nothing is resolved at
/// intake).
#[actix_rt::test]
async fn the_default_guard_refuses_internal_webhook_urls_at_intake() {
    let env = TestEnv::new().await;
    let base = api(&env, UrlGuard::strict(), Hosts::Any);
    for (i, url) in [
        "http://127.0.0.1:9/hook",
        "http://2130706433/",
        "http://0x7f.0.0.1/",
        "http://[::1]:9/",
        "http://[::ffff:127.0.0.1]/",
        "http://localhost:9/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.7/",
        "http://192.168.1.1/",
        "http://[fd00::1]/",
        "http://0.0.0.0:9/",
    ]
    .into_iter()
    .enumerate()
    {
        let (status, body) = post_json(&base, &job_body(&format!("ssrf-{i}"), url)).await;
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["error"]["field"], "webhook_url", "{url}: {body}");
    }
    let stored = env.sql("SELECT id FROM jobs").await;
    assert_eq!(stored, json!([]), "nothing was stored");
    let (status, body) =
        post_json(&base, &job_body("public-1", "https://hooks.example.com/x")).await;
    assert_eq!(status, 201, "{body}");
}

/// The binary's default refuses loopback webhooks; the test suite opens the
/// guard explicitly everywhere else.
#[actix_rt::test]
async fn serve_refuses_loopback_webhooks_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let env = TestEnv::new().await;
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("ONCEFLOW_ALLOW_PRIVATE_URLS", "false".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let (status, body) = post_json(&serve.base, &job_body("default-1", &env.consumer.url())).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["field"], "webhook_url");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ONCEFLOW_ALLOW_PRIVATE_URLS"),
        "the message says how to open it: {body}"
    );
}

/// A literal internal address that reached the store anyway (submitted
/// before the guard, or by hand) is refused when the webhook is sent: the
/// job is `dead` with the reason, and the service there sees nothing.
#[actix_rt::test]
async fn an_internal_address_is_refused_at_send_time() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.url_guard = UrlGuard::strict();
    let _engine = env.start(registry(), config);
    env.submit("send-1", "hello").await; // webhook_url: the loopback consumer
    let job = env.wait_for("send-1", JobState::Dead, WAIT).await;
    let error = job.last_error.unwrap();
    assert_eq!(error.code, "url_refused");
    assert!(error.message.contains("loopback"), "{}", error.message);
    assert_eq!(env.consumer.deliveries().len(), 0, "nothing reached it");
    assert_eq!(job.delivery.unwrap().status, "dead");
}

/// No redirect is followed: a 3xx is a permanent failure with a clear
/// reason, and the redirect's target sees no request.
#[actix_rt::test]
async fn a_redirect_is_not_followed() {
    let env = TestEnv::new().await;
    let target = FakeConsumer::start();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let location = target.url();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut buf = [0u8; 65536];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                format!("HTTP/1.1 307 Temporary Redirect\r\nlocation: {location}\r\ncontent-length: 0\r\n\r\n")
                    .as_bytes(),
            );
        }
    });
    let _engine = env.start(registry(), env.config());
    env.submit_job(NewJob {
        id: "redirect-1".into(),
        workflow: "completion".into(),
        input: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        webhook_url: url,
    })
    .await;
    let job = env.wait_for("redirect-1", JobState::Dead, WAIT).await;
    let error = job.last_error.unwrap();
    assert_eq!(error.code, "http_307");
    assert!(
        error.message.contains("redirects are not followed"),
        "{}",
        error.message
    );
    assert_eq!(
        target.deliveries().len(),
        0,
        "the redirect's target saw nothing"
    );
}

/// A tool's request goes through the same guard: a model cannot steer the
/// built-in `http_post` tool at an internal address.
#[actix_rt::test]
async fn a_tool_request_to_an_internal_address_is_refused() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "ticket": "A" }))]);
    let mut r = Registry::new();
    r.register(Agent::new().with_tool(HttpPost::new(tools.url())));
    let mut config = env.config();
    // The webhook consumer is allowed; the tool's loopback target is not.
    config.url_guard = UrlGuard::strict().allowing_url(&env.consumer.url());
    let _engine = env.start(r, config);
    env.submit_job(NewJob {
        id: "tool-ssrf".into(),
        workflow: "agent".into(),
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "go" }] }),
        webhook_url: env.consumer.url(),
    })
    .await;
    let job = env.wait_for("tool-ssrf", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "url_refused");
    assert_eq!(tools.deliveries().len(), 0, "the tool's target saw nothing");
}

/// A webhook consumer's error body is never shown back: the job records the
/// status and onceflow's own words.
#[actix_rt::test]
async fn a_consumer_error_body_is_not_reflected() {
    let env = TestEnv::new().await;
    env.consumer.push(Behaviour::Status(500, None));
    let _engine = env.start(registry(), env.config());
    env.submit("reflect-1", "hello").await;
    let job = env.wait_for("reflect-1", JobState::Acked, WAIT).await;
    assert_eq!(env.consumer.deliveries_for("reflect-1").len(), 2);
    let last = job.delivery.unwrap().last_error.unwrap();
    assert_eq!(last.code, "http_500");
    assert_eq!(last.message, "HTTP 500", "the consumer's body stays out");
}

/// A provider answering 100 MB: the job is `dead` with `response_too_large`
/// (not retried), and onceflow hung up long before the end.
#[actix_rt::test]
async fn a_huge_provider_answer_is_cut_off() {
    let env = TestEnv::new().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let written = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let (w, n) = (written.clone(), requests.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            n.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 65536];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
            );
            let chunk = vec![b' '; 64 * 1024];
            let framed = [
                format!("{:x}\r\n", chunk.len()).into_bytes(),
                chunk,
                b"\r\n".to_vec(),
            ]
            .concat();
            while w.load(Ordering::SeqCst) < 100 << 20 {
                if stream.write_all(&framed).is_err() {
                    break;
                }
                w.fetch_add(64 * 1024, Ordering::SeqCst);
            }
        }
    });
    let mut config = env.config();
    config.provider.base_url = base;
    config.provider.timeout = Duration::from_secs(10);
    let _engine = env.start(registry(), config);
    env.submit("huge-1", "hello").await;
    let job = env.wait_for("huge-1", JobState::Dead, WAIT).await;
    assert_eq!(job.last_error.unwrap().code, "response_too_large");
    assert_eq!(requests.load(Ordering::SeqCst), 1, "not retried");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = written.load(Ordering::SeqCst);
    assert!(
        sent < 32 << 20,
        "onceflow kept reading: the provider wrote {sent} bytes"
    );
    eprintln!(
        "the provider wrote {} KiB before onceflow hung up",
        sent >> 10
    );
}

/// Only JSON may be posted (a form or text/plain POST is what any web page
/// can send cross-site without a preflight), and only to a Host this server
/// answers (DNS rebinding).
#[actix_rt::test]
async fn posts_must_be_json_and_hosts_must_be_known() {
    let env = TestEnv::new().await;
    let base = serve_api_for(|addr| ApiState {
        store: env.store.clone(),
        registry: registry(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: UrlGuard::allow_private(),
        hosts: Hosts::for_listen(addr, &[]),
    });
    let body = serde_json::to_vec(&job_body("ct-1", &env.consumer.url())).unwrap();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let (status, answer) = post(&base, content_type, body.clone()).await;
        assert_eq!(status, 415, "{content_type}: {answer}");
    }
    assert_eq!(env.sql("SELECT id FROM jobs").await, json!([]));
    let (status, _) = post(&base, "application/json; charset=utf-8", body.clone()).await;
    assert_eq!(status, 201);
    // A rebinding attacker's page sends its own name as Host.
    let port = base.rsplit(':').next().unwrap();
    for (host, expected) in [
        (format!("evil.example:{port}"), 421),
        (format!("localhost:{port}"), 200),
        (format!("127.0.0.1:{port}"), 200),
    ] {
        let r = client()
            .get(format!("{base}/v1/jobs/ct-1"))
            .header("host", host.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), expected, "Host: {host}");
    }
}

/// Strict JSON at intake: a NUL anywhere is a `422` naming the field, a
/// duplicate key is a `400`, an over-long URL is a `422`.
#[actix_rt::test]
async fn intake_refuses_nul_duplicate_keys_and_long_urls() {
    let env = TestEnv::new().await;
    let base = api(&env, UrlGuard::allow_private(), Hosts::Any);
    let mut body = job_body("nul-1", &env.consumer.url());
    body["input"]["messages"][0]["content"] = json!("a\u{0}b");
    let (status, answer) = post_json(&base, &body).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["error"]["field"], "input.messages[0].content");
    let dup = br#"{"id": "dup-1", "id": "dup-2", "workflow": "completion", "webhook_url": "http://127.0.0.1:9/", "input": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}"#;
    let (status, answer) = post(&base, "application/json", dup.to_vec()).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("duplicate key"));
    let long = format!("https://hooks.example.com/{}", "a".repeat(2100));
    let (status, answer) = post_json(&base, &job_body("long-1", &long)).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["error"]["field"], "webhook_url");
    assert_eq!(env.sql("SELECT id FROM jobs").await, json!([]));
}
