//! Safe to expose: the SSRF guard (at intake, at send time, no redirects),
//! nothing internal reflected, bounded answers, JSON-only and Host-checked
//! requests, no cross-site changes, strict JSON at intake.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::api::{ApiState, Auth, Bounds, Hosts, DEFAULT_BODY_LIMIT};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::{wait_until, Behaviour, FakeConsumer, TestEnv};
use onceflow_engine::{JobState, Registry, UrlGuard};
use onceflow_workflows::{Agent, Completion, HttpPost};
use serde_json::{json, Value};

use crate::support::{client, serve_api_for, serve_api_state, ServeProcess};

const WAIT: Duration = Duration::from_secs(20);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r.register(Agent::new());
    r
}

fn api(env: &TestEnv, guard: UrlGuard, hosts: Hosts) -> String {
    api_with(env, guard, hosts, Auth::Off)
}

fn api_with(env: &TestEnv, guard: UrlGuard, hosts: Hosts, auth: Auth) -> String {
    api_limited(env, guard, hosts, auth, Bounds::default())
}

fn api_limited(env: &TestEnv, guard: UrlGuard, hosts: Hosts, auth: Auth, limits: Bounds) -> String {
    serve_api_state(ApiState {
        store: env.store.clone(),
        registry: registry(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: guard,
        hosts,
        auth,
        limits,
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
    })
}

/// Development mode (no tokens) that answers only its own listen address
/// as `Host`, as `serve` on loopback does.
fn api_answering_its_listen_address(env: &TestEnv) -> String {
    serve_api_for(|addr| ApiState {
        store: env.store.clone(),
        registry: registry(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: UrlGuard::allow_private(),
        hosts: Hosts::for_listen(addr, &[]),
        auth: Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
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
        tags: Default::default(),
        id: "redirect-1".into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        webhook_url: url,
        schedule: Default::default(),
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
/// built-in `http_post` tool at an internal address; the refusal the job's
/// owner reads does not quote the operator's tool URL.
#[actix_rt::test]
async fn a_tool_request_to_an_internal_address_is_refused() {
    let env = TestEnv::new().await;
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_1", json!({ "ticket": "A" }))]);
    let mut r = Registry::new();
    // The operator's tool URL may carry a key: it is never shown to the job's owner.
    let tool_url = format!("{}?key=s3cret", tools.url());
    r.register(Agent::new().with_tool(HttpPost::new(tool_url)));
    let mut config = env.config();
    // The webhook consumer is allowed; the tool's loopback target is not.
    config.url_guard = UrlGuard::strict().allowing_url(&env.consumer.url());
    let _engine = env.start(r, config);
    env.submit_job(NewJob {
        tags: Default::default(),
        id: "tool-ssrf".into(),
        workflow: "agent".into(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "go" }] }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("tool-ssrf", JobState::Dead, WAIT).await;
    let reason = job.dead_reason.unwrap();
    let error = job.last_error.unwrap();
    assert_eq!(error.code, "url_refused");
    assert!(
        !reason.contains("s3cret") && !error.message.contains("s3cret"),
        "{reason} / {error:?}"
    );
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
    let base = api_answering_its_listen_address(&env);
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

/// Development mode (loopback, no tokens) answers requests without a token,
/// so a page of another site could cancel or submit with a body-less or
/// JSON `POST` and the right `Host`: a request that names another origin
/// (`Origin`, or `Sec-Fetch-Site` without it) is a `403` and changes
/// nothing; the server's own origin (the console) passes.
#[actix_rt::test]
async fn a_page_of_another_site_can_change_nothing() {
    let env = TestEnv::new().await;
    let base = api_answering_its_listen_address(&env);
    let mut job = job_body("xs-1", &env.consumer.url());
    job["delay_ms"] = json!(3_600_000);
    let (status, answer) = post_json(&base, &job).await;
    assert_eq!(status, 201, "{answer}");
    let authority = base.strip_prefix("http://").unwrap().to_owned();
    let refused: [(&str, &str); 4] = [
        ("origin", "http://evil.example"),
        ("origin", "null"),
        ("origin", "http://127.0.0.1.evil.example"),
        ("sec-fetch-site", "cross-site"),
    ];
    for (name, value) in refused {
        for path in [
            "/v1/jobs/xs-1/cancel",
            "/v1/jobs/redrive?confirm_unknown=true",
        ] {
            let r = client()
                .post(format!("{base}{path}"))
                .header(name, value)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let answer: Value = r.json().await.unwrap_or(Value::Null);
            assert_eq!(status, 403, "{name}: {value} {path}: {answer}");
            assert_eq!(answer["error"]["code"], "cross_site", "{answer}");
        }
        let r = client()
            .post(format!("{base}/v1/jobs"))
            .header(name, value)
            .json(&job_body("xs-2", &env.consumer.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 403, "{name}: {value} submit");
    }
    assert_eq!(
        env.sql("SELECT id, state::text FROM jobs ORDER BY id")
            .await,
        json!([{ "id": "xs-1", "state": "received" }]),
        "nothing was cancelled or submitted"
    );
    // The server's own page (the console) may act.
    let r = client()
        .post(format!("{base}/v1/jobs/xs-1/cancel"))
        .header("origin", format!("http://{authority}"))
        .header("sec-fetch-site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    assert_eq!(
        env.sql("SELECT state::text FROM jobs WHERE id = 'xs-1'")
            .await,
        json!([{ "state": "cancelled" }])
    );
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
    // Documented upper bounds on what a job may cost.
    let mut body = job_body("tokens-1", &env.consumer.url());
    body["input"]["max_tokens"] = json!(2_000_000);
    let (status, answer) = post_json(&base, &body).await;
    assert_eq!(
        (status, answer["error"]["field"].clone()),
        (422, json!("input.max_tokens"))
    );
    let mut body = job_body("turns-1", &env.consumer.url());
    body["workflow"] = json!("agent");
    body["input"]["max_turns"] = json!(65);
    let (status, answer) = post_json(&base, &body).await;
    assert_eq!(
        (status, answer["error"]["field"].clone()),
        (422, json!("input.max_turns"))
    );
    assert_eq!(env.sql("SELECT id FROM jobs").await, json!([]));
}

async fn call(
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value, Option<String>) {
    let mut r = client().request(method, url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.json(b);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, r.json().await.unwrap_or(Value::Null), challenge)
}

/// Event streams are bounded: each reads the journal until its job ends,
/// on the pool the engine writes through, so a caller could otherwise open
/// thousands. One more than a token's or the node's bound is a `429`
/// naming it; a closed stream gives its place back.
#[actix_rt::test]
async fn event_streams_are_bounded_per_token_and_per_node() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let mut limits = Bounds::default();
    limits.max_streams = 3;
    limits.max_streams_per_token = 2;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
        limits,
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    for (id, token) in [("st-a", &alice), ("st-b", &bob)] {
        let mut job = job_body(id, &env.consumer.url());
        job["delay_ms"] = json!(3_600_000); // never ends while the test runs
        let url = format!("{base}/v1/jobs");
        let (status, answer, _) = call(Method::POST, &url, Some(token), Some(&job)).await;
        assert_eq!(status, 201, "{answer}");
    }
    let open = |id: &'static str, token: String| {
        let url = format!("{base}/v1/jobs/{id}/events");
        async move { client().get(url).bearer_auth(token).send().await.unwrap() }
    };
    let refused = |r: reqwest::Response, why: &'static str| async move {
        assert_eq!(r.status().as_u16(), 429, "{why}");
        assert!(r.headers().contains_key("retry-after"), "{why}");
        let answer: Value = r.json().await.unwrap();
        assert_eq!(
            answer["error"]["code"], "too_many_streams",
            "{why}: {answer}"
        );
        answer["error"]["message"].as_str().unwrap().to_owned()
    };
    let a1 = open("st-a", alice.clone()).await;
    let a2 = open("st-a", alice.clone()).await;
    assert_eq!((a1.status().as_u16(), a2.status().as_u16()), (200, 200));
    let message = refused(open("st-a", alice.clone()).await, "alice's third").await;
    assert!(message.contains("this token"), "{message}");
    let b1 = open("st-b", bob.clone()).await;
    assert_eq!(b1.status().as_u16(), 200, "bob's first: the node has 3");
    let message = refused(open("st-b", bob.clone()).await, "the node's fourth").await;
    assert!(message.contains("this node"), "{message}");
    // Alice leaves one: its place comes back once the server sees it go,
    // at the latest when a keep-alive comment (every 15 s) fails to send.
    drop(a1);
    let left = std::time::Instant::now();
    assert!(
        wait_until(Duration::from_secs(45), || async {
            open("st-a", alice.clone()).await.status().as_u16() == 200
        })
        .await,
        "a closed stream gave its place back"
    );
    eprintln!(
        "a closed stream's place came back after {:?}",
        left.elapsed()
    );
    drop((a2, b1));
}

/// API tokens: once one exists every request needs one; a token sees only
/// its own jobs (another's is a 404 like a missing one, and its id a 409
/// that says nothing more); an admin token sees all; revoked is 401.
#[actix_rt::test]
async fn tokens_scope_every_job_to_its_owner() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
    );
    let hook = env.consumer.url();
    // Development mode: no token exists yet, so none is needed on loopback.
    let (status, _, _) = call(
        Method::POST,
        &format!("{base}/v1/jobs"),
        None,
        Some(&job_body("dev-1", &hook)),
    )
    .await;
    assert_eq!(status, 201);
    // ...but not through a reverse proxy, which would open it to the world.
    let proxied = client()
        .get(format!("{base}/v1/jobs/dev-1"))
        .header("x-forwarded-for", "203.0.113.7")
        .send()
        .await
        .unwrap();
    assert_eq!(proxied.status().as_u16(), 401);

    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let admin = env.store.tokens().create("ops", true).await.unwrap();
    assert!(alice.starts_with("of_") && alice != bob);
    let stored = env.sql("SELECT token_hash FROM api_tokens").await;
    assert!(!stored.to_string().contains(&alice), "stored hashed");

    let jobs = format!("{base}/v1/jobs");
    let (status, body, challenge) =
        call(Method::POST, &jobs, None, Some(&job_body("a-1", &hook))).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(challenge.as_deref(), Some("Bearer"));
    let (status, _, _) = call(
        Method::POST,
        &jobs,
        Some("of_not-a-token"),
        Some(&job_body("a-1", &hook)),
    )
    .await;
    assert_eq!(status, 401);
    // Tokens never travel in URLs: a query parameter is not a credential
    // (no operation takes `token`: refused before anything is read).
    let (status, body, _) = call(
        Method::GET,
        &format!("{jobs}/dev-1?token={alice}"),
        None,
        None,
    )
    .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("token"))
    );

    let (status, _, _) = call(
        Method::POST,
        &jobs,
        Some(&alice),
        Some(&job_body("a-1", &hook)),
    )
    .await;
    assert_eq!(status, 201);
    let (status, _, _) = call(Method::GET, &format!("{jobs}/a-1"), Some(&alice), None).await;
    assert_eq!(status, 200);
    // Bob: alice's job looks exactly like a job that does not exist.
    let (status, theirs, _) = call(Method::GET, &format!("{jobs}/a-1"), Some(&bob), None).await;
    let (_, missing, _) = call(Method::GET, &format!("{jobs}/a-9"), Some(&bob), None).await;
    assert_eq!(status, 404);
    assert_eq!(theirs["error"]["code"], missing["error"]["code"]);
    // Her id is taken, identical request or not, and that is all he learns.
    let (s1, same, _) = call(
        Method::POST,
        &jobs,
        Some(&bob),
        Some(&job_body("a-1", &hook)),
    )
    .await;
    let mut other = job_body("a-1", &hook);
    other["input"]["model"] = json!("other");
    let (s2, different, _) = call(Method::POST, &jobs, Some(&bob), Some(&other)).await;
    assert_eq!((s1, s2), (409, 409));
    assert_eq!(same, different, "identical and different look the same");
    assert!(!same.to_string().contains("different"), "{same}");
    assert_eq!(env.job("a-1").await.input["model"], "m", "untouched");
    // The admin token sees every job, alice only hers.
    for id in ["a-1", "dev-1"] {
        let (status, _, _) = call(Method::GET, &format!("{jobs}/{id}"), Some(&admin), None).await;
        assert_eq!(status, 200, "{id}");
    }
    let (status, _, _) = call(Method::GET, &format!("{jobs}/dev-1"), Some(&alice), None).await;
    assert_eq!(status, 404);
    // /metrics needs a token; /healthz never does.
    let (status, _, _) = call(Method::GET, &format!("{base}/metrics"), None, None).await;
    assert_eq!(status, 401);
    let r = client()
        .get(format!("{base}/metrics"))
        .bearer_auth(&bob)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (status, _, _) = call(Method::GET, &format!("{base}/healthz"), None, None).await;
    assert_eq!(status, 200);
    // Revoked: 401.
    assert!(env.store.tokens().revoke("alice").await.unwrap());
    let (status, _, _) = call(Method::GET, &format!("{jobs}/a-1"), Some(&alice), None).await;
    assert_eq!(status, 401);
}

/// A signal is a write to a job: it needs a token, another token's job is a
/// 404 exactly like a missing one, and nothing is recorded for it; a bad
/// name is a 422 naming `name`.
#[actix_rt::test]
async fn a_signal_reaches_only_its_own_tokens_job() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let admin = env.store.tokens().create("ops", true).await.unwrap();
    let mut job = job_body("sig-a", &env.consumer.url());
    job["delay_ms"] = json!(3_600_000); // never runs while the test does
    let (status, body, _) = call(
        Method::POST,
        &format!("{base}/v1/jobs"),
        Some(&alice),
        Some(&job),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let signal = json!({ "id": "s-1", "payload": { "approved": true } });
    let url = |job: &str, name: &str| format!("{base}/v1/jobs/{job}/signals/{name}");

    let (status, _, challenge) = call(Method::POST, &url("sig-a", "go"), None, Some(&signal)).await;
    assert_eq!((status, challenge.as_deref()), (401, Some("Bearer")));
    let (status, theirs, _) =
        call(Method::POST, &url("sig-a", "go"), Some(&bob), Some(&signal)).await;
    let (missing_status, missing, _) =
        call(Method::POST, &url("sig-z", "go"), Some(&bob), Some(&signal)).await;
    assert_eq!((status, missing_status), (404, 404));
    assert_eq!(
        theirs.to_string().replace("sig-a", "ID"),
        missing.to_string().replace("sig-z", "ID"),
        "another's job looks like no job"
    );
    let recorded = env.sql("SELECT count(*) AS n FROM signals").await;
    assert_eq!(recorded[0]["n"], 0, "nothing recorded for bob: {recorded}");

    for name in ["g%20o", &"n".repeat(201)] {
        let (status, body, _) = call(
            Method::POST,
            &url("sig-a", name),
            Some(&alice),
            Some(&signal),
        )
        .await;
        assert_eq!(
            (status, body["error"]["field"].as_str()),
            (422, Some("name")),
            "{name}: {body}"
        );
    }
    let (status, body, _) = call(
        Method::POST,
        &url("sig-a", "go"),
        Some(&alice),
        Some(&signal),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let (status, _, _) = call(
        Method::POST,
        &url("sig-a", "go"),
        Some(&admin),
        Some(&signal),
    )
    .await;
    assert_eq!(
        status, 200,
        "the admin token sees it: the identical signal again"
    );
    let recorded = env.sql("SELECT signal_id, name FROM signals").await;
    assert_eq!(recorded, json!([{ "signal_id": "s-1", "name": "go" }]));
}

/// Off loopback there is no development mode: no token means 401, before
/// any token exists and after the last one is revoked.
#[actix_rt::test]
async fn off_loopback_every_request_needs_a_token_even_with_none_left() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let jobs = format!("{base}/v1/jobs");
    let body = job_body("x-1", &env.consumer.url());
    assert_eq!(call(Method::POST, &jobs, None, Some(&body)).await.0, 401);
    let token = env.store.tokens().create("only", false).await.unwrap();
    assert_eq!(
        call(Method::POST, &jobs, Some(&token), Some(&body)).await.0,
        201
    );
    assert!(env.store.tokens().revoke("only").await.unwrap());
    assert_eq!(
        call(Method::GET, &format!("{jobs}/x-1"), None, None)
            .await
            .0,
        401
    );
    assert_eq!(
        call(
            Method::POST,
            &jobs,
            None,
            Some(&job_body("x-2", &env.consumer.url()))
        )
        .await
        .0,
        401
    );
    assert_eq!(env.sql("SELECT id FROM jobs").await, json!([{"id": "x-1"}]));
}

/// The binary: `serve` refuses a non-loopback address until a token
/// exists; `token create` prints the token alone on its last line; the CLI
/// sends `ONCEFLOW_TOKEN`.
#[actix_rt::test]
async fn serve_off_loopback_needs_a_token_and_the_cli_sends_it() {
    use std::process::{Command, Stdio};
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_onceflow");
    let port = crate::support::free_port();
    let refused = Command::new(bin)
        .arg("serve")
        .env("DATABASE_URL", &env.db_url)
        .env("ONCEFLOW_LISTEN", format!("0.0.0.0:{port}"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("token create"), "{stderr}");

    let created = Command::new(bin)
        .args(["token", "create", "--name", "ci", "--admin"])
        .env("DATABASE_URL", &env.db_url)
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    // The first token closes the API, /metrics included: said at once.
    let said = String::from_utf8_lossy(&created.stderr);
    assert!(
        said.contains("first token") && said.contains("/metrics"),
        "{said}"
    );
    let stdout = String::from_utf8(created.stdout).unwrap();
    let token = stdout.lines().last().unwrap().trim().to_owned();
    assert!(token.starts_with("of_") && token.len() > 40, "{stdout:?}");

    let serve = ServeProcess::start_on(
        port,
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("ONCEFLOW_LISTEN", format!("0.0.0.0:{port}")),
            ("ONCEFLOW_ALLOWED_HOSTS", "127.0.0.1".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let submit = |token: Option<&str>| {
        let mut cmd = Command::new(bin);
        cmd.args(["submit", "--id", "cli-1", "--prompt", "hi", "--webhook-url"])
            .arg(env.consumer.url())
            .args(["--server", &serve.base])
            .env_remove("ONCEFLOW_TOKEN");
        if let Some(t) = token {
            cmd.env("ONCEFLOW_TOKEN", t);
        }
        cmd.output().unwrap()
    };
    let anonymous = submit(None);
    assert!(!anonymous.status.success());
    assert!(String::from_utf8_lossy(&anonymous.stderr).contains("401"));
    let ok = submit(Some(&token));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let status = Command::new(bin)
        .args(["status", "cli-1", "--json", "--server", &serve.base])
        .env("ONCEFLOW_TOKEN", &token)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let job: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(job["id"], "cli-1");
}

/// A full backlog is refused with `429` and `Retry-After`, in total and per
/// token; nothing is stored.
#[actix_rt::test]
async fn a_full_backlog_is_refused_with_retry_after() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
        Bounds::backlog(3, 2),
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let jobs = format!("{base}/v1/jobs");
    let hook = env.consumer.url();
    for id in ["b-1", "b-2"] {
        assert_eq!(
            call(
                Method::POST,
                &jobs,
                Some(&alice),
                Some(&job_body(id, &hook))
            )
            .await
            .0,
            201
        );
    }
    // The counts are read at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = client()
        .post(&jobs)
        .bearer_auth(&alice)
        .json(&job_body("b-3", &hook))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429, "alice's own backlog is full");
    assert_eq!(r.headers()["retry-after"], "5");
    // Bob has room of his own, until the total is reached.
    assert_eq!(
        call(
            Method::POST,
            &jobs,
            Some(&bob),
            Some(&job_body("c-1", &hook))
        )
        .await
        .0,
        201
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, body, _) = call(
        Method::POST,
        &jobs,
        Some(&bob),
        Some(&job_body("c-2", &hook)),
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "backlog_full");
    // Refused before the body is read: a body that is not even JSON is
    // answered 429, not 400.
    let r = client()
        .post(&jobs)
        .bearer_auth(&bob)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429, "the backlog is looked at first");
    assert_eq!(env.sql("SELECT count(*) AS n FROM jobs").await[0]["n"], 3);
}

/// The per-token limit holds for the cluster under a burst: 40 concurrent
/// submits from one token with a limit of 5, split between two nodes,
/// store 5 jobs, not 5 per node (10 before intake decided it).
#[actix_rt::test]
async fn a_burst_of_submits_stops_at_the_backlog_limit() {
    let env = TestEnv::new().await;
    let node = || {
        api_limited(
            &env,
            UrlGuard::allow_private(),
            Hosts::Any,
            Auth::Tokens { loopback: true },
            Bounds::backlog(1_000, 5),
        )
    };
    let nodes = [node(), node()];
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let hook = env.consumer.url();
    let sends = (0..40).map(|i| {
        let jobs = format!("{}/v1/jobs", nodes[i % 2]);
        let (alice, hook) = (alice.clone(), hook.clone());
        async move {
            client()
                .post(&jobs)
                .bearer_auth(&alice)
                .json(&job_body(&format!("burst-{i}"), &hook))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    });
    let statuses = futures_util::future::join_all(sends).await;
    let created = statuses.iter().filter(|s| **s == 201).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((created, refused), (5, 35), "{statuses:?}");
    assert_eq!(env.sql("SELECT count(*) AS n FROM jobs").await[0]["n"], 5);
}

/// A request refused (`422`) or an identical resubmission takes no place
/// in its token's backlog: with a limit of 3 and 2 jobs stored, 20 bad
/// requests and 20 repeats of a stored job leave room for exactly one more,
/// taken by a new job sent in one batch beside another repeat.
#[actix_rt::test]
async fn refused_and_repeated_submits_take_no_place_in_the_backlog() {
    let env = TestEnv::new().await;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
        Bounds::backlog(1_000, 3),
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let jobs = format!("{base}/v1/jobs");
    let hook = env.consumer.url();
    let send = |body: Value| {
        let (jobs, alice) = (jobs.clone(), alice.clone());
        async move {
            client()
                .post(&jobs)
                .bearer_auth(&alice)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    for id in ["p-1", "p-2"] {
        assert_eq!(send(job_body(id, &hook)).await, 201);
    }
    let mut noise = Vec::new();
    for i in 0..20 {
        let mut bad = job_body(&format!("bad-{i}"), &hook);
        bad["workflow"] = json!("no-such-workflow");
        noise.push(send(bad));
        noise.push(send(job_body("p-1", &hook)));
    }
    let statuses = futures_util::future::join_all(noise).await;
    assert_eq!(statuses.iter().filter(|s| **s == 422).count(), 20);
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 20);
    // A repeat and a new job in one batch: the repeat takes no place.
    let r = client()
        .post(format!("{base}/v1/jobs/batch"))
        .bearer_auth(&alice)
        .json(&json!({ "jobs": [job_body("p-1", &hook), job_body("p-3", &hook)] }))
        .send()
        .await
        .unwrap();
    let answer: Value = r.json().await.unwrap();
    let statuses: Vec<&Value> = answer["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["status"])
        .collect();
    assert_eq!(
        statuses,
        [&json!(200), &json!(201)],
        "room for one more: {answer}"
    );
    assert_eq!(send(job_body("p-4", &hook)).await, 429, "and no more");
    assert_eq!(env.sql("SELECT count(*) AS n FROM jobs").await[0]["n"], 3);
}

/// Small bounds answered the same way everywhere: the `Authorization`
/// scheme is case-insensitive (RFC 9110); a `run_at` in the past means now,
/// never ahead of the jobs already due; a number with a fraction where an
/// integer is expected is a `422` naming the field, in a bulk redrive's
/// `limit` as in a submit's `priority`.
#[actix_rt::test]
async fn small_bounds_are_answered_alike() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
        Bounds::default(),
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let jobs = format!("{base}/v1/jobs");
    let hook = env.consumer.url();
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let r = client()
            .get(&jobs)
            .header("authorization", format!("{scheme} {alice}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{scheme}");
    }
    let r = client()
        .get(&jobs)
        .header("authorization", format!("Basic {alice}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "another scheme");

    let mut early = job_body("early", &hook);
    early["run_at"] = json!("0001-01-01T00:00:00Z");
    let (status, body, _) = call(Method::POST, &jobs, Some(&alice), Some(&early)).await;
    assert_eq!(status, 201, "{body}");
    let row = env
        .sql("SELECT run_at >= created_at AS now_or_later FROM jobs WHERE id = 'early'")
        .await;
    assert_eq!(row[0]["now_or_later"], true, "a past run_at means now");

    let mut priority = job_body("fraction", &hook);
    priority["priority"] = json!(1.0);
    let (status, body, _) = call(Method::POST, &jobs, Some(&alice), Some(&priority)).await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("priority")),
        "{body}"
    );
    let (status, body, _) = call(
        Method::POST,
        &format!("{jobs}/redrive"),
        Some(&alice),
        Some(&json!({ "limit": 99.0 })),
    )
    .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("limit")),
        "{body}"
    );
    let (status, body, _) = call(
        Method::POST,
        &format!("{jobs}/redrive"),
        Some(&alice),
        Some(&json!({ "limit": 5, "surprise": 1 })),
    )
    .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (422, Some("surprise")),
        "{body}"
    );
}

/// The day-one operations keep to the caller's token: another token's job
/// cannot be rerun (404), a bulk cancel and a tag filter never reach it,
/// and a batch naming its id is told only that the id is not available.
#[actix_rt::test]
async fn bulk_rerun_batch_and_tags_keep_to_the_callers_token() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
        Bounds::default(),
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let jobs = format!("{base}/v1/jobs");
    let mut body = job_body("a-1", &env.consumer.url());
    body["tags"] = json!({ "team": "a" });
    body["delay_ms"] = json!(3_600_000);
    let (status, _, _) = call(Method::POST, &jobs, Some(&alice), Some(&body)).await;
    assert_eq!(status, 201);
    let (status, _, _) = call(
        Method::POST,
        &format!("{jobs}/a-1/rerun"),
        Some(&bob),
        Some(&json!({ "id": "b-copy" })),
    )
    .await;
    assert_eq!(status, 404, "another token's job is not there to rerun");
    let (status, answer, _) = call(
        Method::POST,
        &format!("{jobs}/cancel"),
        Some(&bob),
        Some(&json!({ "tag": "team:a" })),
    )
    .await;
    assert_eq!((status, &answer), (202, &json!({ "cancelled": 0 })));
    let (_, page, _) = call(Method::GET, &format!("{jobs}?tag=team:a"), Some(&bob), None).await;
    assert_eq!(page["jobs"], json!([]), "bob lists none of alice's");
    let (status, answer, _) = call(
        Method::POST,
        &format!("{jobs}/batch"),
        Some(&bob),
        Some(&json!({ "jobs": [body] })),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["jobs"][0]["status"], 409);
    assert!(
        answer["jobs"][0].get("job").is_none(),
        "nothing of alice's job is shown"
    );
    assert_eq!(
        env.job("a-1").await.state,
        onceflow_engine::JobState::Received
    );
    let (_, page, _) = call(
        Method::GET,
        &format!("{jobs}?tag=team:a"),
        Some(&alice),
        None,
    )
    .await;
    assert_eq!(page["jobs"][0]["id"], "a-1", "alice lists her own");
}

/// A client that dribbles its body is cut off (`408`), not waited for.
#[actix_rt::test]
async fn a_dribbled_body_times_out() {
    let env = TestEnv::new().await;
    let mut limits = Bounds::default();
    limits.body_timeout = Duration::from_millis(500);
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Off,
        limits,
    );
    // Intake, and an action's body (cancel) the same.
    for path in ["/v1/jobs", "/v1/jobs/x/cancel"] {
        let addr = base.trim_start_matches("http://").to_owned();
        let answer = tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream
                .write_all(
                    format!(
                        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"id\""
                    )
                    .as_bytes(),
                )
                .unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let started = std::time::Instant::now();
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap_or(0);
            (String::from_utf8_lossy(&buf[..n]).into_owned(), started.elapsed())
        })
        .await
        .unwrap();
        assert!(
            answer.0.starts_with("HTTP/1.1 408"),
            "{path}: {:?}",
            answer.0
        );
        assert!(answer.1 < Duration::from_secs(5), "{path}: {:?}", answer.1);
    }
}

/// Revoking the last token does not bring development mode back: every
/// request still needs a live token (401) until the operator releases the
/// revoked tokens explicitly; a live token blocks that.
#[actix_rt::test]
async fn revoking_the_last_token_keeps_the_api_closed() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
    );
    let stats = format!("{base}/v1/stats");
    assert_eq!(
        call(Method::GET, &stats, None, None).await.0,
        200,
        "no token has ever existed: development mode"
    );
    let token = env.store.tokens().create("only", false).await.unwrap();
    assert_eq!(call(Method::GET, &stats, None, None).await.0, 401);
    assert_eq!(call(Method::GET, &stats, Some(&token), None).await.0, 200);
    assert!(
        env.store.tokens().open_development_mode().await.is_err(),
        "refused while a live token exists"
    );
    assert!(env.store.tokens().revoke("only").await.unwrap());
    let (status, answer, _) = call(Method::GET, &stats, None, None).await;
    assert_eq!(
        status, 401,
        "the last token revoked: still closed ({answer})"
    );
    assert_eq!(call(Method::GET, &stats, Some(&token), None).await.0, 401);
    assert_eq!(env.store.tokens().open_development_mode().await.unwrap(), 1);
    assert_eq!(
        call(Method::GET, &stats, None, None).await.0,
        200,
        "reopened by the operator, explicitly"
    );
}

/// A NUL character in a path, a query or an action's reason is a `422`
/// naming where (PostgreSQL cannot hold one; it was a `503`), and every
/// answer carries `X-Content-Type-Options: nosniff`.
#[actix_rt::test]
async fn nul_characters_are_refused_by_name_and_answers_say_nosniff() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api(&env, UrlGuard::allow_private(), Hosts::Any);
    env.submit("nul-target", "hi").await;
    for (method, url, body, field) in [
        (Method::GET, format!("{base}/v1/jobs/%00"), None, "path"),
        (
            Method::GET,
            format!("{base}/v1/jobs/a%00b/events"),
            None,
            "path",
        ),
        (
            Method::GET,
            format!("{base}/v1/jobs?workflow=%00"),
            None,
            "query",
        ),
        (
            Method::POST,
            format!("{base}/v1/jobs/nul-target/cancel"),
            Some(json!({"reason": "a\u{0}b"})),
            "reason",
        ),
    ] {
        let (status, answer, _) = call(method, &url, None, body.as_ref()).await;
        assert_eq!(status, 422, "{url}: {answer}");
        assert_eq!(answer["error"]["field"], field, "{url}: {answer}");
    }
    assert_eq!(
        env.job("nul-target").await.state,
        onceflow_engine::JobState::Received
    );
    for url in [
        format!("{base}/v1/jobs/nul-target"),
        format!("{base}/v1/jobs/missing"),
        format!("{base}/v1/jobs/%00"),
        format!("{base}/nowhere"),
        format!("{base}/healthz"),
    ] {
        let r = client().get(&url).send().await.unwrap();
        assert_eq!(
            r.headers()
                .get("x-content-type-options")
                .and_then(|v| v.to_str().ok()),
            Some("nosniff"),
            "{url}"
        );
    }
}

/// A secret is never taken from a command-line flag (visible in `ps`):
/// `--token`, a provider key, a signing secret and a database URL with a
/// password are refused (exit 2, naming the variable to set, never
/// repeating the value) before anything runs; from the environment they
/// are taken as before.
#[test]
fn a_secret_on_the_command_line_is_refused() {
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"));
        cmd.args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let status = ["status", "x", "--server", "http://127.0.0.1:9"];
    for (extra, named) in [
        (vec!["--token", "secret-token"], "ONCEFLOW_TOKEN"),
        (vec!["--token=secret-token"], "ONCEFLOW_TOKEN"),
    ] {
        let args: Vec<&str> = status.iter().copied().chain(extra).collect();
        let (code, stderr) = run(&args, &[]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains(&format!("set {named} instead")), "{stderr}");
        assert!(!stderr.contains("secret-token"), "{stderr}");
    }
    for (args, named) in [
        (
            vec!["serve", "--openai-api-key", "sk-secret-token"],
            "OPENAI_API_KEY",
        ),
        (
            vec!["serve", "--webhook-secret", "whsec_secret-token"],
            "ONCEFLOW_WEBHOOK_SECRET",
        ),
        (
            vec![
                "migrate",
                "--database-url",
                "postgres://u:secret-token@127.0.0.1:9/db",
            ],
            "DATABASE_URL",
        ),
    ] {
        let (code, stderr) = run(&args, &[]);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("set {named} instead")), "{stderr}");
        assert!(!stderr.contains("secret-token"), "{stderr}");
    }
    // From the environment: taken, and the command runs (here it fails to
    // connect, not to parse).
    let (code, stderr) = run(&status, &[("ONCEFLOW_TOKEN", "secret-token")]);
    assert_ne!(code, Some(2), "{stderr}");
    assert!(!stderr.contains("instead"), "{stderr}");
}

/// A failed send to a caller's URL is stored as a fixed class
/// (`connect_failed`, `dns_failed`), never the operating system's words,
/// which would let a tenant scan ports and names through `last_error`.
#[actix_rt::test]
async fn a_failed_send_stores_a_class_not_the_systems_words() {
    let env = TestEnv::new().await;
    let closed = crate::support::free_port();
    let _engine = env.start(registry(), env.config());
    for (id, url, class) in [
        (
            "class-connect",
            format!("http://127.0.0.1:{closed}/hook"),
            "connect_failed",
        ),
        (
            "class-dns",
            "http://no-such-host.invalid/hook".to_owned(),
            "dns_failed",
        ),
    ] {
        env.submit_job(onceflow_engine::node::intake::NewJob {
            tags: Default::default(),
            id: id.into(),
            workflow: "completion".into(),
            workflow_version: 1,
            input: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            webhook_url: url,
            schedule: Default::default(),
        })
        .await;
        let job = env.wait_for(id, JobState::Dead, WAIT).await;
        for error in [
            job.last_error.clone().unwrap(),
            job.delivery.clone().unwrap().last_error.unwrap(),
        ] {
            assert!(error.message.starts_with(class), "{id}: {error:?}");
            for word in [
                "os error",
                "refused",
                "not known",
                "lookup",
                "127.0.0.1",
                "invalid",
            ] {
                assert!(!error.message.contains(word), "{id}: {error:?}");
            }
        }
    }
}

/// Each token's jobs are signed with that token's own secret: token B
/// submitting a job to A's consumer cannot get a webhook A's secret
/// verifies. Admin tokens sign with the node's secret. A rotation keeps the
/// previous secret beside the new one.
#[actix_rt::test]
async fn each_tokens_webhooks_are_signed_with_its_own_secret() {
    use onceflow_engine::net::webhook::WebhookSecret;
    use reqwest::Method;
    let env = TestEnv::new().await;
    let node_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut config = env.config();
    config.webhook_secret = Some(node_secret.parse().unwrap());
    let _engine = env.start(registry(), config);
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let mut tokens = Vec::new();
    for (name, admin) in [("tenant-a", false), ("tenant-b", false), ("operator", true)] {
        let token = env.store.tokens().create(name, admin).await.unwrap();
        let secret = env.store.tokens().secret(name).await.unwrap();
        assert_eq!(secret.is_some(), !admin, "{name}");
        tokens.push((name, token, secret));
    }
    for (name, token, _) in &tokens {
        let id = format!("sig-{name}");
        let (status, answer, _) = call(
            Method::POST,
            &format!("{base}/v1/jobs"),
            Some(token),
            Some(&job_body(&id, &env.consumer.url())),
        )
        .await;
        assert_eq!(status, 201, "{answer}");
    }
    let verifies = |id: &str, secret: &str| {
        let d = &env.consumer.deliveries_for(id)[0];
        let key: WebhookSecret = secret.parse().unwrap();
        let ts: i64 = d.timestamp.as_deref().unwrap().parse().unwrap();
        d.signature.as_deref()
            == Some(
                key.sign(d.webhook_id.as_deref().unwrap(), ts, &d.raw)
                    .as_str(),
            )
    };
    for (name, _, _) in &tokens {
        env.wait_for(&format!("sig-{name}"), JobState::Acked, WAIT)
            .await;
    }
    let a = tokens[0].2.clone().unwrap();
    let b = tokens[1].2.clone().unwrap();
    assert!(verifies("sig-tenant-a", &a));
    assert!(!verifies("sig-tenant-a", &b) && !verifies("sig-tenant-a", node_secret));
    assert!(verifies("sig-tenant-b", &b));
    assert!(
        !verifies("sig-tenant-b", &a),
        "A's secret must reject B's job sent to A's consumer"
    );
    assert!(!verifies("sig-tenant-b", node_secret));
    assert!(verifies("sig-operator", node_secret));
    // Rotation: the new secret first, the previous one kept beside it.
    let new = env.store.tokens().rotate_secret("tenant-a").await.unwrap();
    assert_eq!(
        env.store.tokens().secret("tenant-a").await.unwrap(),
        Some(format!("{new} {a}"))
    );
    assert!(env.store.tokens().rotate_secret("operator").await.is_err());
}

/// A token that is not admin may not push its jobs ahead of everyone's:
/// its `priority` is bounded (422 naming the field); an admin's is not.
#[actix_rt::test]
async fn a_tenants_priority_is_bounded() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let tenant = env.store.tokens().create("tenant", false).await.unwrap();
    let admin = env.store.tokens().create("admin", true).await.unwrap();
    let submit = |id: &str, token: &str, priority: i64| {
        let mut body = job_body(id, &env.consumer.url());
        body["priority"] = json!(priority);
        let url = format!("{base}/v1/jobs");
        let token = token.to_owned();
        async move { call(Method::POST, &url, Some(&token), Some(&body)).await }
    };
    let (status, answer, _) = submit("prio-high", &tenant, 1_000_000).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["error"]["field"], "priority");
    assert_eq!(submit("prio-ok", &tenant, 100).await.0, 201);
    assert_eq!(submit("prio-low", &tenant, -101).await.0, 422);
    assert_eq!(submit("prio-admin", &admin, 1_000_000).await.0, 201);
}

/// A revoked token's open event stream ends at once, on every node: the
/// revocation (made here through another store handle, as `onceflow token
/// revoke` would) is announced by `NOTIFY`, not found by the stream's
/// once-a-minute safety read.
#[actix_rt::test]
async fn a_revoked_tokens_stream_ends_at_once() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let _node = env.start(registry(), env.config()); // its LISTEN hears the NOTIFY
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let mut job = job_body("rv-1", &env.consumer.url());
    job["delay_ms"] = json!(3_600_000); // never ends while the test runs
    let url = format!("{base}/v1/jobs");
    let (status, answer, _) = call(Method::POST, &url, Some(&alice), Some(&job)).await;
    assert_eq!(status, 201, "{answer}");
    let mut stream = client()
        .get(format!("{base}/v1/jobs/rv-1/events"))
        .bearer_auth(&alice)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status().as_u16(), 200);
    let followed = wait_until(Duration::from_secs(10), || async {
        env.sql("SELECT count(*) AS n FROM stream_watchers WHERE job_id = 'rv-1'")
            .await[0]["n"]
            .as_i64()
            == Some(1)
    })
    .await;
    assert!(followed, "the stream is open");
    let cli =
        onceflow_engine::Store::new(onceflow_engine::Db::connect(&env.db_url, 1).await.unwrap());
    assert!(cli.tokens().revoke("alice").await.unwrap());
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(_chunk) = stream.chunk().await.expect("reading events") {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the revoked token's stream did not end within 5 s"
    );
}

/// Whether the Standard Webhooks reference library (PyPI `standardwebhooks`,
/// installed by `.ci/run`) accepts delivery `d` under `secret`.
async fn reference_verifies(d: &onceflow_engine::testkit::Delivery, secret: &str) -> bool {
    const VERIFY: &str = "import json, sys\n\
from standardwebhooks.webhooks import Webhook, WebhookVerificationError\n\
a = json.load(sys.stdin)\n\
headers = {'webhook-id': a['id'], 'webhook-timestamp': a['timestamp'], 'webhook-signature': a['signature']}\n\
try:\n    Webhook(a['secret']).verify(a['body'], headers)\nexcept WebhookVerificationError:\n    sys.exit(1)\n";
    let input = json!({
        "secret": secret,
        "id": d.webhook_id,
        "timestamp": d.timestamp,
        "signature": d.signature,
        "body": String::from_utf8(d.raw.clone()).unwrap(),
    })
    .to_string();
    let output = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new("python3")
            .args(["-c", VERIFY])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python3 (the reference library's language) runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    match output.status.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!(
            "the reference library did not run (pip install standardwebhooks): {}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// Checked by the Standard Webhooks reference library, as a tenant's
/// consumer would: a job's completion webhook and its `job.dead` event are
/// signed with its token's own secret (another tenant's and the node's
/// secrets are rejected), and a rotation reaches the running node at once:
/// the next webhook verifies under the new secret alone, and under the
/// previous one kept beside it.
#[actix_rt::test]
async fn tenant_webhooks_and_events_pass_the_reference_library_across_a_rotation() {
    use reqwest::Method;
    let env = TestEnv::new().await;
    let node_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut config = env.config();
    config.webhook_secret = Some(node_secret.parse().unwrap());
    let with_events = || {
        let mut r = registry();
        r.with_failure_events(true);
        r
    };
    let _engine = env.start(with_events(), config);
    let base = serve_api_state(ApiState {
        store: env.store.clone(),
        registry: with_events(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: UrlGuard::allow_private(),
        hosts: Hosts::Any,
        auth: Auth::Tokens { loopback: false },
        limits: Bounds::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
    });
    let a = env.store.tokens().create("tenant-a", false).await.unwrap();
    env.store.tokens().create("tenant-b", false).await.unwrap();
    let a_secret = env
        .store
        .tokens()
        .secret("tenant-a")
        .await
        .unwrap()
        .unwrap();
    let b_secret = env
        .store
        .tokens()
        .secret("tenant-b")
        .await
        .unwrap()
        .unwrap();
    let submit = |id: &'static str| {
        let (base, a, hook) = (base.clone(), a.clone(), env.consumer.url());
        async move {
            let (status, answer, _) = call(
                Method::POST,
                &format!("{base}/v1/jobs"),
                Some(&a),
                Some(&job_body(id, &hook)),
            )
            .await;
            assert_eq!(status, 201, "{answer}");
        }
    };
    // The model refuses the first job for good: it dies, and says so.
    env.provider.push(Behaviour::Status(400, None));
    submit("ref-dead").await;
    env.wait_for("ref-dead", JobState::Dead, WAIT).await;
    assert!(
        wait_until(WAIT, || async {
            env.consumer
                .deliveries_for("ref-dead")
                .iter()
                .any(|d| d.body["type"] == "job.dead")
        })
        .await,
        "the job.dead event was sent"
    );
    let dead = env.consumer.deliveries_for("ref-dead").remove(0);
    assert_eq!(dead.body["type"], "job.dead");
    submit("ref-done").await;
    env.wait_for("ref-done", JobState::Acked, WAIT).await;
    let done = env.consumer.deliveries_for("ref-done").remove(0);
    for (d, id) in [(&dead, "ref-dead"), (&done, "ref-done")] {
        let what = &d.body["type"];
        // The Standard Webhooks envelope, the time in one format whether
        // the body was built by SQL (job.dead) or by the node (completed).
        assert_eq!(d.body["data"]["job_id"], id, "{what}: {}", d.body);
        let at = d.body["timestamp"].as_str().unwrap_or_default();
        assert!(
            at.len() == 27 && at.ends_with('Z') && chrono::DateTime::parse_from_rfc3339(at).is_ok(),
            "{what}: timestamp {at:?}"
        );
        assert_eq!(
            d.body.as_object().map(|o| o.len()),
            Some(3),
            "{what}: type, timestamp and data only: {}",
            d.body
        );
        assert!(reference_verifies(d, &a_secret).await, "{what}: A's secret");
        assert!(
            !reference_verifies(d, &b_secret).await,
            "{what}: B's secret must reject it"
        );
        assert!(
            !reference_verifies(d, node_secret).await,
            "{what}: the node's secret must reject it"
        );
    }
    // Rotated while the node runs (and has A's old secret cached).
    let rotated = env.store.tokens().rotate_secret("tenant-a").await.unwrap();
    submit("ref-rotated").await;
    env.wait_for("ref-rotated", JobState::Acked, WAIT).await;
    let after = env.consumer.deliveries_for("ref-rotated").remove(0);
    assert!(
        reference_verifies(&after, &rotated).await,
        "the rotation reached the running node at once"
    );
    assert!(
        reference_verifies(&after, &a_secret).await,
        "the previous secret still verifies"
    );
    assert!(!reference_verifies(&after, &b_secret).await);
}

/// Jobs submitted in development mode belong to no token: creating a
/// tenant's token says that it will not see them; a second token does not
/// repeat the first token's warning.
#[actix_rt::test]
async fn a_tenant_token_created_over_development_mode_jobs_says_it_will_not_see_them() {
    let env = TestEnv::new().await;
    env.store
        .jobs()
        .submit(&onceflow_engine::store::Submission::new(&NewJob {
            tags: Default::default(),
            id: "dev-1".into(),
            workflow: "completion".into(),
            workflow_version: 1,
            input: json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] }),
            webhook_url: env.consumer.url(),
            schedule: Default::default(),
        }))
        .await
        .unwrap();
    let create = |name: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"))
            .args(["token", "create", "--name", name])
            .env("DATABASE_URL", &env.db_url)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let first = create("tenant-one");
    assert!(
        first.contains("1 jobs submitted in development mode"),
        "{first}"
    );
    assert!(first.contains("first token"), "{first}");
    let second = create("tenant-two");
    assert!(second.contains("development mode"), "{second}");
    assert!(!second.contains("first token"), "{second}");
}

/// The OpenAPI document is served without a token (it holds nothing
/// secret) while every API route needs one, and it is the engine's own.
#[actix_rt::test]
async fn the_openapi_document_is_served_open_and_is_the_engines() {
    let env = TestEnv::new().await;
    env.store.tokens().create("someone", false).await.unwrap();
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let r = client()
        .get(format!("{base}/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let served: Value = r.json().await.unwrap();
    let built = serde_json::to_value(onceflow_engine::api::openapi::document()).unwrap();
    assert_eq!(served, built);
    let jobs = client()
        .get(format!("{base}/v1/jobs"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        jobs.status().as_u16(),
        401,
        "the API itself still needs a token"
    );
}

/// `GET /v1/openapi.json` stays open, but a caller without a token (where
/// tokens exist) gets the API alone: the node's workflows and their input
/// schemas name a deployment's own work, and only a caller the API would
/// serve sees them.
#[actix_rt::test]
async fn the_open_openapi_document_names_no_workflow_without_a_token() {
    let env = TestEnv::new().await;
    let token = env.store.tokens().create("reader", false).await.unwrap();
    let base = api_with(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: false },
    );
    let url = format!("{base}/v1/openapi.json");
    let anonymous = client().get(&url).send().await.unwrap();
    assert_eq!(anonymous.status().as_u16(), 200, "the document is open");
    let anonymous = anonymous.text().await.unwrap();
    let with_token = client()
        .get(&url)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in registry().names() {
        let named = format!("\"const\":\"{name}\"");
        assert!(!anonymous.contains(&named), "{name} shown without a token");
        assert!(with_token.contains(&named), "{name} not shown with a token");
    }
    let bad = client()
        .get(&url)
        .bearer_auth("not-a-token")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 200);
    assert_eq!(
        bad.text().await.unwrap(),
        anonymous,
        "a bad token is no token"
    );
}

/// A re-run is a submit of the original's request under the new id: it
/// keeps the concurrency key, priority and tags (so the key's limit binds
/// it), and its webhook URL passes the guard of the node that takes it: a
/// URL this node refuses is `422 webhook_url` and creates nothing, before
/// any model call is paid.
#[actix_rt::test]
async fn a_rerun_takes_the_submit_path_key_priority_tags_and_guard() {
    let env = TestEnv::new().await;
    let open = api(&env, UrlGuard::allow_private(), Hosts::Any);
    let strict = api(&env, UrlGuard::strict(), Hosts::Any);
    let mut body = job_body("orig", &env.consumer.url());
    body["concurrency_key"] = json!("user-7");
    body["priority"] = json!(3);
    body["tags"] = json!({ "team": "a" });
    let (status, created) = post_json(&open, &body).await;
    assert_eq!(status, 201, "{created}");
    let rerun = |base: &str, id: &str| {
        client()
            .post(format!("{base}/v1/jobs/orig/rerun"))
            .json(&json!({ "id": id }))
            .send()
    };
    let r = rerun(&open, "again").await.unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let again = env.job("again").await;
    assert_eq!(again.concurrency_key.as_deref(), Some("user-7"));
    assert_eq!(again.priority, 3);
    assert_eq!(again.tags, env.job("orig").await.tags);
    let r = rerun(&strict, "refused").await.unwrap();
    let status = r.status().as_u16();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(
        (status, answer["error"]["field"].as_str()),
        (422, Some("webhook_url")),
        "{answer}"
    );
    assert_eq!(
        env.sql("SELECT count(*) AS n FROM jobs WHERE id = 'refused'")
            .await[0]["n"],
        json!(0),
        "nothing created"
    );
}

/// The bytes of intake bodies a node holds at once are bounded, per token
/// too, before anything is read: while Alice's batch without a declared
/// length (it holds the largest a batch may be, 16 MiB) is still arriving,
/// her next batch of 2 MB would pass her 17 MB and is `429 busy` with
/// `Retry-After`, nothing of it stored; Bob's 2 MB batch fits the node's
/// 40 MB and is taken. Once Alice's first is answered, her second is taken.
#[actix_rt::test]
async fn the_bytes_of_bodies_a_node_holds_are_bounded_per_token_too() {
    let env = TestEnv::new().await;
    let mut bounds = Bounds::default();
    bounds.max_body_bytes = 40_000_000;
    bounds.max_body_bytes_per_token = 17_000_000;
    let base = api_limited(
        &env,
        UrlGuard::allow_private(),
        Hosts::Any,
        Auth::Tokens { loopback: true },
        bounds,
    );
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let hook = env.consumer.url();
    let batch = |prefix: &str, n: usize, pad: usize| {
        let jobs: Vec<Value> = (0..n)
            .map(|i| {
                let mut job = job_body(&format!("{prefix}-{i}"), &hook);
                job["input"]["messages"][0]["content"] = json!("x".repeat(pad));
                job
            })
            .collect();
        serde_json::to_vec(&json!({ "jobs": jobs })).unwrap()
    };
    // Alice's first batch, chunked, its last chunk held back a while.
    let first = batch("slow", 2, 10);
    let addr = base.trim_start_matches("http://").to_owned();
    let alice_first = alice.clone();
    let slow = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        let head = format!(
            "POST /v1/jobs/batch HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {alice_first}\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).unwrap();
        let (a, b) = first.split_at(first.len() / 2);
        write!(stream, "{:x}\r\n", a.len()).unwrap();
        stream.write_all(a).unwrap();
        stream.write_all(b"\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        write!(stream, "{:x}\r\n", b.len()).unwrap();
        stream.write_all(b).unwrap();
        stream.write_all(b"\r\n0\r\n\r\n").unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let send = |token: &str, body: Vec<u8>| {
        client()
            .post(format!("{base}/v1/jobs/batch"))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let second = batch("alice", 2, 1_000_000);
    let r = send(&alice, second.clone()).await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["error"]["code"], "busy", "{answer}");
    let r = send(&bob, batch("bob", 2, 1_000_000)).await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "Bob's fits the node");
    let first_answer = tokio::task::spawn_blocking(move || slow.join().unwrap())
        .await
        .unwrap();
    assert!(first_answer.starts_with("HTTP/1.1 200"), "{first_answer}");
    let r = send(&alice, second).await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "room again once the first was answered"
    );
    let stored = env
        .sql(
            "SELECT count(*) FILTER (WHERE id LIKE 'slow-%') AS slow, \
                     count(*) FILTER (WHERE id LIKE 'alice-%') AS alice, \
                     count(*) FILTER (WHERE id LIKE 'bob-%') AS bob FROM jobs",
        )
        .await[0]
        .clone();
    assert_eq!(stored, json!({ "slow": 2, "alice": 2, "bob": 2 }));
}
