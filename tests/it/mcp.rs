//! Agent tools from MCP servers nobody here wrote: a server built with the
//! official Python SDK that counts every `tools/call` it receives (with the
//! key in its `_meta`), and the MCP project's reference server
//! (`@modelcontextprotocol/server-everything`), both over streamable HTTP.
//! `scripts/mcp-servers` installs them (the tests run it when needed).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{JobState, Registry};
use onceflow_workflows::mcp::McpServers;
use onceflow_workflows::{Agent, Completion};
use serde_json::{json, Value};

use crate::support::{client, free_port, serve_api, ServeProcess};

const WAIT: Duration = Duration::from_secs(30);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `scripts/mcp-servers` once per test binary (it does nothing when
/// the servers are installed).
fn installed() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let status = Command::new("bash")
            .arg(root().join("scripts/mcp-servers"))
            .status()
            .expect("bash runs scripts/mcp-servers");
        assert!(status.success(), "scripts/mcp-servers failed: {status}");
    });
}

/// An MCP server process, killed when dropped.
struct McpServer {
    child: Child,
    port: u16,
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl McpServer {
    /// The counting server (Python SDK): `lookup` (read-only), `refund` (no
    /// hints), `cancel_order` (idempotent), `broken` (answers isError).
    async fn counting() -> McpServer {
        installed();
        let python: PathBuf = root().join("target/mcp/venv/bin/python");
        let port = free_port();
        let child = Command::new(python)
            .arg(root().join("tests/mcp/counting_server.py"))
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // The SDK logs every session; a failing test shows the calls.
            .stderr(Stdio::null())
            .spawn()
            .expect("start the counting MCP server");
        let server = McpServer { child, port };
        let up = wait_until(Duration::from_secs(30), || async {
            client()
                .get(format!("http://127.0.0.1:{port}/calls"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await;
        assert!(up, "the counting MCP server did not start");
        server
    }

    /// The MCP project's reference server, over streamable HTTP.
    async fn everything() -> McpServer {
        installed();
        let port = free_port();
        let child = Command::new("node")
            .arg(root().join(
                "tests/mcp/node_modules/@modelcontextprotocol/server-everything/dist/index.js",
            ))
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start server-everything (node)");
        let server = McpServer { child, port };
        let up = wait_until(Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        assert!(up, "server-everything did not start");
        server
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Every `tools/call` request the server received: `{tool, key, arguments}`.
    async fn calls(&self) -> Vec<Value> {
        client()
            .get(format!("http://127.0.0.1:{}/calls", self.port))
            .send()
            .await
            .expect("GET /calls")
            .json()
            .await
            .expect("the calls as JSON")
    }

    /// The `tools/call` requests of `tool`, each by the key it carried.
    async fn keys_of(&self, tool: &str) -> Vec<String> {
        self.calls()
            .await
            .iter()
            .filter(|c| c["tool"] == tool)
            .map(|c| c["key"].as_str().unwrap_or("<no key>").to_owned())
            .collect()
    }
}

/// The real `onceflow serve` with the counting server as `shop` (its
/// Authorization header read from the environment), an admin token, and
/// the variables to restart it with.
struct Node {
    serve: ServeProcess,
    vars: Vec<(&'static str, String)>,
    log: PathBuf,
    token: String,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start(env: &TestEnv, shop: &McpServer) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("serve.log");
        let setting = json!({ "shop": { "url": shop.url(),
            "headers": { "Authorization": { "env": "SHOP_MCP_TOKEN" } } } });
        let vars = vec![
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_MCP_SERVERS", setting.to_string()),
            ("SHOP_MCP_TOKEN", "Bearer s3cret-shop".to_owned()),
            ("ONCEFLOW_POLL_MS", "100".to_owned()),
            ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
        ];
        let serve = ServeProcess::start(&vars, &log).await;
        let token = env.store.tokens().create("mcp", true).await.unwrap();
        Node {
            serve,
            vars,
            log,
            token,
            _dir: dir,
        }
    }

    /// Killed with SIGKILL, then started again on the same port.
    async fn kill_9_and_restart(&mut self) {
        self.serve.sigkill();
        self.serve.restart_on_same_port(&self.vars, &self.log).await;
    }

    /// Submits an agent job on `shop` whose first message is `prompt`.
    async fn submit(&self, env: &TestEnv, id: &str, prompt: &str, extra: Value) {
        let mut input = json!({ "model": "m", "messages": [{ "role": "user", "content": prompt }],
                                "mcp": ["shop"] });
        for (k, v) in extra.as_object().unwrap() {
            input[k] = v.clone();
        }
        let r = client()
            .post(format!("{}/v1/jobs", self.serve.base))
            .bearer_auth(&self.token)
            .json(&json!({ "id": id, "workflow": "agent", "webhook_url": env.consumer.url(), "input": input }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
    }
}

fn servers(named: &[(&str, &McpServer)]) -> McpServers {
    let setting: serde_json::Map<String, Value> = named
        .iter()
        .map(|(name, s)| ((*name).to_owned(), json!({ "url": s.url() })))
        .collect();
    McpServers::from_setting(&Value::Object(setting).to_string()).expect("a valid setting")
}

fn registry(mcp: McpServers) -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r.register(Agent::new().with_mcp_servers(mcp));
    r
}

/// A provider script: until the conversation holds a tool answer, ask for
/// `calls` (id, tool, arguments); then answer "done".
fn script(env: &TestEnv, calls: Vec<(&'static str, &'static str, Value)>) {
    crate::agent::script_named_calls(env, calls);
}

/// The model's answer once a tool answered, else the calls `ask` makes of
/// the conversation's first message.
fn script_by_prompt(
    env: &TestEnv,
    ask: impl Fn(&str) -> Vec<(&'static str, &'static str, Value)> + Send + Sync + 'static,
) {
    env.provider.respond_with(move |request, n| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let answers = messages.iter().filter(|m| m["role"] == "tool").count();
        let prompt = messages[0]["content"].as_str().unwrap_or_default();
        let calls = if answers == 0 { ask(prompt) } else { vec![] };
        let message = if calls.is_empty() {
            json!({ "role": "assistant", "content": format!("done #{n}") })
        } else {
            crate::agent::tool_calls_message(&calls)
        };
        crate::agent::chat_answer(request, n, message)
    });
}

fn job(env: &TestEnv, id: &str, input: Value) -> NewJob {
    let mut base = json!({ "model": "m", "messages": [{ "role": "user", "content": "help" }] });
    for (k, v) in input.as_object().unwrap() {
        base[k] = v.clone();
    }
    NewJob {
        tags: Default::default(),
        id: id.to_owned(),
        workflow: "agent".to_owned(),
        workflow_version: 1,
        input: base,
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    }
}

/// The tool names the model was offered, per request to the provider.
fn offered(env: &TestEnv) -> Vec<Vec<String>> {
    env.provider
        .requests()
        .iter()
        .map(|r| {
            r.body["tools"]
                .as_array()
                .map(|tools| {
                    tools
                        .iter()
                        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect()
}

/// The tool messages the model was shown, in order, over all requests.
fn tool_answers(env: &TestEnv) -> Vec<String> {
    crate::agent::tool_messages(env)
}

#[actix_rt::test]
async fn each_mcp_tool_call_is_sent_once_with_the_jobs_key_and_replayed_from_the_ledger() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script(
        &env,
        vec![
            ("call_l", "mcp__shop__lookup", json!({ "order_id": "A1" })),
            (
                "call_r",
                "mcp__shop__refund",
                json!({ "order_id": "A1", "amount": 5 }),
            ),
            ("call_b", "mcp__shop__broken", json!({ "order_id": "Z9" })),
        ],
    );
    // Turn 1 fails once after the tools ran: its retry replays their
    // journaled answers, and the server hears nothing more.
    env.provider.push(onceflow_engine::testkit::Behaviour::Ok);
    env.provider
        .push(onceflow_engine::testkit::Behaviour::Status(500, None));
    let config = env.config();
    let telemetry = config.telemetry.clone();
    let _engine = env.start(registry(servers(&[("shop", &shop)])), config);
    env.submit_job(job(&env, "mcp-1", json!({ "mcp": ["shop"] })))
        .await;
    let done = env.wait_for("mcp-1", JobState::Acked, WAIT).await;
    assert_eq!(done.result.unwrap()["tool_calls"], 3);
    let metrics = telemetry.prometheus();
    for (outcome, want) in [("performed", 3), ("replayed", 3)] {
        let line = format!(
            "onceflow_mcp_calls_total{{onceflow_mcp_server=\"shop\",onceflow_outcome=\"{outcome}\"}} {want}"
        );
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }

    // What the server received: one request per call, each with its key.
    assert_eq!(shop.keys_of("lookup").await, ["job:mcp-1:tool:call_l"]);
    assert_eq!(shop.keys_of("refund").await, ["job:mcp-1:tool:call_r"]);
    assert_eq!(shop.keys_of("broken").await, ["job:mcp-1:tool:call_b"]);
    assert_eq!(shop.calls().await.len(), 3, "{:?}", shop.calls().await);
    assert_eq!(
        shop.calls().await[1]["arguments"],
        json!({ "order_id": "A1", "amount": 5 })
    );

    // Turn 0, then turn 1 twice (the 500 and its retry): the same pinned
    // list each time, under the mcp__{server}__{tool} names.
    let lists = offered(&env);
    assert_eq!(lists.len(), 3, "{lists:?}");
    assert!(lists.iter().all(|l| l == &lists[0]), "{lists:?}");
    for name in [
        "mcp__shop__lookup",
        "mcp__shop__refund",
        "mcp__shop__cancel_order",
        "mcp__shop__broken",
    ] {
        assert!(lists[0].iter().any(|n| n == name), "{name} in {lists:?}");
    }
    // The model read each answer, a tool's own error included; both turn-1
    // requests carried the same journaled answers.
    let answers = tool_answers(&env);
    assert_eq!(answers.len(), 6, "{answers:?}");
    assert_eq!(answers[..3], answers[3..]);
    assert_eq!(answers[0], "order A1 is shipped");
    assert_eq!(answers[1], "refunded 5 on order A1");
    assert!(
        answers[2].starts_with("The tool reported an error"),
        "{}",
        answers[2]
    );
    let ledger = env
        .sql("SELECT tool_name, status::text AS status FROM tool_calls WHERE job_id = 'mcp-1' ORDER BY call_index")
        .await;
    assert_eq!(
        ledger,
        json!([
            { "tool_name": "mcp__shop__lookup", "status": "completed" },
            { "tool_name": "mcp__shop__refund", "status": "completed" },
            { "tool_name": "mcp__shop__broken", "status": "completed" },
        ])
    );
    assert_eq!(env.consumer.processed_for("mcp-1"), 1, "one webhook");
}

#[actix_rt::test]
async fn the_reference_servers_tools_are_listed_and_called() {
    let env = TestEnv::new().await;
    let everything = McpServer::everything().await;
    script(
        &env,
        vec![(
            "call_e",
            "mcp__everything__echo",
            json!({ "message": "hello from onceflow" }),
        )],
    );
    let _engine = env.start(
        registry(servers(&[("everything", &everything)])),
        env.config(),
    );
    env.submit_job(job(&env, "mcp-e", json!({ "mcp": ["everything"] })))
        .await;
    let done = env.wait_for("mcp-e", JobState::Acked, WAIT).await;
    assert_eq!(done.result.unwrap()["tool_calls"], 1);
    let lists = offered(&env);
    assert!(
        lists[0].iter().any(|n| n == "mcp__everything__echo")
            && lists[0].iter().any(|n| n == "mcp__everything__get-sum"),
        "{lists:?}"
    );
    assert_eq!(tool_answers(&env), ["Echo: hello from onceflow"]);
}

#[actix_rt::test]
async fn a_server_down_at_tools_list_is_retried_then_a_clear_error() {
    let env = TestEnv::new().await;
    script(&env, vec![]);
    let down = format!("http://127.0.0.1:{}/mcp", free_port());
    let mcp = McpServers::from_setting(&json!({ "gone": { "url": down } }).to_string()).unwrap();
    let _engine = env.start(registry(mcp), env.config());
    env.submit_job(job(&env, "mcp-down", json!({ "mcp": ["gone"] })))
        .await;
    let dead = env.wait_for("mcp-down", JobState::Dead, WAIT).await;
    let error = dead.last_error.expect("a recorded error");
    assert_eq!(error.code, "mcp_unavailable");
    assert!(error.message.contains("\"gone\""), "{}", error.message);
    // The server's address is the operator's: the job's owner reads its name.
    assert!(!error.message.contains("127.0.0.1"), "{}", error.message);
    assert_eq!(dead.attempts, 6, "retried to the budget of 6");
    assert_eq!(env.provider.requests().len(), 0, "no model call was paid");
}

#[actix_rt::test]
async fn the_pinned_tool_list_wins_on_a_node_whose_server_lists_others() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    let other = McpServer::everything().await;
    script(
        &env,
        vec![(
            "call_p",
            "mcp__shop__refund",
            json!({ "order_id": "P1", "amount": 1 }),
        )],
    );
    // The first node pins the counting server's list, then dies with its
    // first model call answered and unread.
    env.faults
        .arm_nth("mcp-pin", FailPoint::ModelAfterSend, Action::Crash, 1);
    let first = env.start(registry(servers(&[("shop", &shop)])), env.config());
    env.submit_job(job(&env, "mcp-pin", json!({ "mcp": ["shop"] })))
        .await;
    assert!(
        wait_until(WAIT, || async { env.faults.fired("mcp-pin") }).await,
        "the crash after the first model call fired"
    );
    first.shutdown();
    // The second node's "shop" is another server with other tools.
    let _second = env.start(registry(servers(&[("shop", &other)])), env.config());
    // The pinned refund, asked of a server that lists no such tool: that
    // server refuses it, and the job is retried for a node that has it, to
    // its budget.
    let dead = env.wait_for("mcp-pin", JobState::Dead, WAIT).await;
    assert_eq!(dead.last_error.unwrap().code, "tool_unavailable");
    let lists = offered(&env);
    assert_eq!(lists.len(), 2, "{lists:?}");
    assert_eq!(
        lists[0], lists[1],
        "the resumed turn offers the pinned list"
    );
    assert!(
        lists[1].iter().any(|n| n == "mcp__shop__refund"),
        "{lists:?}"
    );
    assert!(
        !lists[1].iter().any(|n| n == "mcp__shop__echo"),
        "{lists:?}"
    );
    assert!(tool_answers(&env).is_empty(), "the model read no answer");
}

#[actix_rt::test]
async fn approval_destructive_asks_before_a_tool_that_may_change_things() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script(
        &env,
        vec![
            ("call_l", "mcp__shop__lookup", json!({ "order_id": "B2" })),
            (
                "call_n",
                "mcp__shop__annotate",
                json!({ "order_id": "B2", "note": "called" }),
            ),
            (
                "call_c",
                "mcp__shop__cancel_order",
                json!({ "order_id": "B2" }),
            ),
            (
                "call_r",
                "mcp__shop__refund",
                json!({ "order_id": "B2", "amount": 9 }),
            ),
        ],
    );
    let mcp = servers(&[("shop", &shop)]);
    let _engine = env.start(registry(mcp.clone()), env.config());
    let base = serve_api(&env, registry(mcp), None);
    env.submit_job(job(
        &env,
        "mcp-ap",
        json!({ "mcp": ["shop"], "approval": "destructive" }),
    ))
    .await;
    let waits_for = |name: &'static str| {
        let env = &env;
        async move {
            wait_until(WAIT, || async {
                env.job("mcp-ap")
                    .await
                    .waiting
                    .is_some_and(|w| w["kind"] == "approval" && w["name"] == name)
            })
            .await
        }
    };
    let approve = |name: &'static str| {
        let base = base.clone();
        async move {
            let r = client()
                .post(format!("{base}/v1/jobs/mcp-ap/signals/{name}"))
                .json(&json!({ "id": format!("ok-{name}"), "payload": { "approved": true } }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 202);
        }
    };
    // The read-only lookup and the non-destructive note ran unasked; the
    // idempotent but destructive cancel waits for a person.
    assert!(
        waits_for("approval:call_c").await,
        "{:?}",
        env.job("mcp-ap").await
    );
    assert_eq!(shop.keys_of("lookup").await, ["job:mcp-ap:tool:call_l"]);
    assert_eq!(shop.keys_of("annotate").await, ["job:mcp-ap:tool:call_n"]);
    assert!(shop.keys_of("cancel_order").await.is_empty());
    assert!(shop.keys_of("refund").await.is_empty());
    approve("approval:call_c").await;
    // Then the refund (no hints) waits, the cancel done once.
    assert!(
        waits_for("approval:call_r").await,
        "{:?}",
        env.job("mcp-ap").await
    );
    assert_eq!(
        shop.keys_of("cancel_order").await,
        ["job:mcp-ap:tool:call_c"]
    );
    assert!(shop.keys_of("refund").await.is_empty());
    approve("approval:call_r").await;
    env.wait_for("mcp-ap", JobState::Acked, WAIT).await;
    assert_eq!(shop.keys_of("refund").await, ["job:mcp-ap:tool:call_r"]);
    assert_eq!(shop.keys_of("lookup").await.len(), 1);
    assert_eq!(shop.keys_of("annotate").await.len(), 1);
    assert_eq!(shop.keys_of("cancel_order").await.len(), 1);
}

#[actix_rt::test]
async fn an_unknown_mcp_server_or_tool_in_the_input_is_refused_naming_the_field() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    let base = serve_api(&env, registry(servers(&[("shop", &shop)])), None);
    for (input, field) in [
        (json!({ "mcp": ["nope"] }), "input.mcp[0]"),
        (json!({ "mcp": ["shop", "shop"] }), "input.mcp[1]"),
        (
            json!({ "mcp": ["shop"], "approval": ["mcp__other__refund"] }),
            "input.approval[0]",
        ),
    ] {
        let mut body = json!({ "id": "refused", "workflow": "agent", "webhook_url": env.consumer.url(),
            "input": { "model": "m", "messages": [{ "role": "user", "content": "x" }] } });
        for (k, v) in input.as_object().unwrap() {
            body["input"][k] = v.clone();
        }
        let r = client()
            .post(format!("{base}/v1/jobs"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let answer: Value = r.json().await.unwrap();
        assert_eq!(
            (status, answer["error"]["field"].as_str()),
            (422, Some(field)),
            "{answer}"
        );
    }
    // A tool of the job's own server may be named before it is listed.
    let r = client()
        .post(format!("{base}/v1/jobs"))
        .json(
            &json!({ "id": "named", "workflow": "agent", "webhook_url": env.consumer.url(),
            "input": { "model": "m", "messages": [{ "role": "user", "content": "x" }],
                       "mcp": ["shop"], "approval": ["mcp__shop__refund"] } }),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
}

/// The real `onceflow serve`, killed with SIGKILL while two MCP calls are
/// in flight at the server: the read-only `lookup` is called again under
/// the same key and its job finishes; the `refund` (no hints) is never
/// called twice — its job ends `dead` with `tool_outcome_unknown`, a
/// redrive without `confirm_unknown` is refused, and one with it calls the
/// refund again, once, under the same key.
#[actix_rt::test]
async fn a_kill_9_mid_call_repeats_only_the_tool_that_says_it_is_safe() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script_by_prompt(&env, |prompt| match prompt {
        "look" => vec![(
            "call_k",
            "mcp__shop__lookup",
            json!({ "order_id": "C3", "hold_ms": 3000 }),
        )],
        _ => vec![(
            "call_k",
            "mcp__shop__refund",
            json!({ "order_id": "C3", "amount": 7, "hold_ms": 3000 }),
        )],
    });
    let mut node = Node::start(&env, &shop).await;
    node.submit(&env, "kill-look", "look", json!({})).await;
    node.submit(&env, "kill-pay", "pay", json!({})).await;
    // Both calls reached the server, which holds its answers; the node dies.
    assert!(
        wait_until(WAIT, || async { shop.calls().await.len() == 2 }).await,
        "both calls reached the server: {:?}",
        shop.calls().await
    );
    node.kill_9_and_restart().await;

    env.wait_for("kill-look", JobState::Acked, WAIT).await;
    assert_eq!(
        shop.keys_of("lookup").await,
        ["job:kill-look:tool:call_k", "job:kill-look:tool:call_k"],
        "the read-only tool was called again, under the same key"
    );
    let dead = env.wait_for("kill-pay", JobState::Dead, WAIT).await;
    let error = dead.last_error.unwrap();
    assert_eq!(error.code, "tool_outcome_unknown");
    assert!(!error.message.contains("127.0.0.1"), "{}", error.message);
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:kill-pay:tool:call_k"],
        "the refund was not called again"
    );
    let status = env
        .sql("SELECT status::text AS status FROM tool_calls WHERE job_id = 'kill-pay'")
        .await;
    assert_eq!(status, json!([{ "status": "unknown" }]));

    let redrive = |confirm: bool| {
        let url = format!(
            "{}/v1/jobs/kill-pay/redrive{}",
            node.serve.base,
            if confirm { "?confirm_unknown=true" } else { "" }
        );
        let token = node.token.clone();
        async move {
            let r = client()
                .post(url)
                .bearer_auth(token)
                .json(&json!({ "reason": "the shop says no refund went out" }))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, body) = redrive(false).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("tool_outcome_unknown")),
        "{body}"
    );
    // Refused means nothing moved: a second later the job is still dead
    // and the refund still sent once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(env.job("kill-pay").await.state, JobState::Dead);
    assert_eq!(shop.keys_of("refund").await.len(), 1);
    let (status, body) = redrive(true).await;
    assert_eq!(status, 202, "{body}");
    env.wait_for("kill-pay", JobState::Acked, WAIT).await;
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:kill-pay:tool:call_k", "job:kill-pay:tool:call_k"],
        "called again once, after the decision, under the same key"
    );
    assert_eq!(env.consumer.processed_for("kill-look"), 1);
    assert_eq!(env.consumer.processed_for("kill-pay"), 1);
    // Every call carried the header the operator gave through the environment.
    let calls = shop.calls().await;
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(
        calls
            .iter()
            .all(|c| c["authorization"] == "Bearer s3cret-shop"),
        "{calls:?}"
    );
    // The restarted node counted what it did, by server and outcome.
    let metrics = client()
        .get(format!("{}/metrics", node.serve.base))
        .bearer_auth(&node.token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = |outcome: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("onceflow_mcp_calls_total{")
                    && l.contains("onceflow_mcp_server=\"shop\"")
                    && l.contains(&format!("onceflow_outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    assert_eq!(series("unknown").as_deref(), Some("1"), "{metrics}");
    // The lookup sent again and the refund after the redrive.
    assert_eq!(series("performed").as_deref(), Some("2"), "{metrics}");
}

/// The operator's configuration is checked before anything starts: an MCP
/// server on loopback needs `ONCEFLOW_ALLOW_PRIVATE_URLS`, and the JSON (which
/// may hold a secret header) is refused on the command line.
#[test]
fn a_private_mcp_server_or_its_json_on_the_command_line_is_refused_at_start() {
    let run = |args: &[&str], vars: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_onceflow"));
        cmd.args(args)
            .env_remove("ONCEFLOW_ALLOW_PRIVATE_URLS")
            .env_remove("ONCEFLOW_MCP_SERVERS")
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:9/none");
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run onceflow");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let setting = r#"{"shop": {"url": "http://127.0.0.1:9/mcp"}}"#;
    let (code, said) = run(&["serve"], &[("ONCEFLOW_MCP_SERVERS", setting)]);
    assert_ne!(code, Some(0));
    assert!(
        said.contains("ONCEFLOW_MCP_SERVERS") && said.contains("shop.url"),
        "{said}"
    );
    let (code, said) = run(&["serve", "--mcp-servers", setting], &[]);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("--mcp-servers is refused") && !said.contains("127.0.0.1:9"),
        "{said}"
    );
    let (code, said) = run(
        &["serve"],
        &[(
            "ONCEFLOW_MCP_SERVERS",
            r#"{"a__b": {"url": "http://x/mcp"}}"#,
        )],
    );
    assert_ne!(code, Some(0));
    assert!(said.contains("server name \"a__b\""), "{said}");
}

/// An approval of an MCP tool through a kill -9 of the real binary: the
/// job waits for the person holding nothing, the node dies and comes back,
/// the approval arrives, and the refund is called once, under its key.
#[actix_rt::test]
async fn an_mcp_tools_approval_survives_kill_9() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script(
        &env,
        vec![(
            "call_a",
            "mcp__shop__refund",
            json!({ "order_id": "D4", "amount": 12 }),
        )],
    );
    let node = &mut Node::start(&env, &shop).await;
    let approval = json!({ "approval": ["mcp__shop__refund"] });
    node.submit(&env, "mcp-kill-ap", "refund D4", approval)
        .await;
    let waiting = wait_until(WAIT, || async {
        env.job("mcp-kill-ap")
            .await
            .waiting
            .is_some_and(|w| w["kind"] == "approval")
    })
    .await;
    let job_now = env.job("mcp-kill-ap").await;
    assert!(waiting, "{job_now:?}");
    let waiting = job_now.waiting.unwrap();
    assert_eq!(waiting["name"], "approval:call_a");
    assert_eq!(waiting["tool"]["name"], "mcp__shop__refund");
    assert_eq!(
        waiting["tool"]["arguments"],
        json!({ "order_id": "D4", "amount": 12 })
    );

    node.kill_9_and_restart().await;
    // The restarted node has polled a dozen times: still nothing runs.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        shop.calls().await.is_empty(),
        "nothing ran before the approval"
    );
    assert!(env.job("mcp-kill-ap").await.waiting.is_some());
    let r = client()
        .post(format!(
            "{}/v1/jobs/mcp-kill-ap/signals/approval:call_a",
            node.serve.base
        ))
        .bearer_auth(&node.token)
        .json(&json!({ "id": "yes-1", "payload": { "approved": true } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let done = env.wait_for("mcp-kill-ap", JobState::Acked, WAIT).await;
    assert_eq!(done.result.unwrap()["tool_calls"], 1);
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:mcp-kill-ap:tool:call_a"],
        "the approved refund was called once"
    );
    assert_eq!(
        env.provider.work_done("job:mcp-kill-ap:turn:0"),
        1,
        "the first turn was paid once through the kill"
    );
}

/// A live node (no crash) whose call gets no answer within its tool
/// timeout: the read-only lookup is sent again under the same key and its
/// job finishes; the refund is not — its job is `dead` with
/// `tool_outcome_unknown`, a redrive without confirmation is refused, and
/// one with it calls the refund once more, under the same key. An answer
/// past the node's bound is a result saying so, never sent again.
#[actix_rt::test]
async fn a_call_timed_out_on_a_live_node_is_sent_again_only_when_safe() {
    use onceflow_engine::store::operate::Redriven;
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script_by_prompt(&env, |prompt| {
        let (name, args) = match prompt {
            "look" => (
                "mcp__shop__lookup",
                json!({ "order_id": "T1", "hold_first_ms": 3000 }),
            ),
            "pay" => (
                "mcp__shop__refund",
                json!({ "order_id": "T2", "amount": 3, "hold_first_ms": 3000 }),
            ),
            _ => ("mcp__shop__big", json!({ "size": 500 })),
        };
        vec![("call_t", name, args)]
    });
    let mut config = env.config(); // a 2 s tool timeout
    config.tool_response_limit = 200;
    let _engine = env.start(registry(servers(&[("shop", &shop)])), config);
    for (id, content) in [("t-look", "look"), ("t-pay", "pay"), ("t-big", "big")] {
        let mut new = job(&env, id, json!({ "mcp": ["shop"] }));
        new.input["messages"][0]["content"] = json!(content);
        env.submit_job(new).await;
    }
    env.wait_for("t-look", JobState::Acked, WAIT).await;
    assert_eq!(
        shop.keys_of("lookup").await,
        ["job:t-look:tool:call_t", "job:t-look:tool:call_t"]
    );
    let dead = env.wait_for("t-pay", JobState::Dead, WAIT).await;
    let error = dead.last_error.unwrap();
    assert_eq!(error.code, "tool_outcome_unknown");
    assert!(!error.message.contains("127.0.0.1"), "{}", error.message);
    assert_eq!(shop.keys_of("refund").await, ["job:t-pay:tool:call_t"]);
    let status = env
        .sql("SELECT status::text AS status FROM tool_calls WHERE job_id = 't-pay'")
        .await;
    assert_eq!(status, json!([{ "status": "unknown" }]));
    let redrive = |confirm| {
        env.store
            .jobs()
            .redrive("t-pay", "test", "checked", confirm)
    };
    assert_eq!(redrive(false).await.unwrap(), Redriven::UnknownToolCall);
    assert!(matches!(redrive(true).await.unwrap(), Redriven::Resumed(_)));
    env.wait_for("t-pay", JobState::Acked, WAIT).await;
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:t-pay:tool:call_t", "job:t-pay:tool:call_t"]
    );

    env.wait_for("t-big", JobState::Acked, WAIT).await;
    assert_eq!(shop.keys_of("big").await.len(), 1);
    let kept = env
        .sql("SELECT status::text AS status, result FROM tool_calls WHERE job_id = 't-big'")
        .await;
    assert_eq!(kept[0]["status"], "completed");
    assert!(
        kept[0]["result"]
            .as_str()
            .unwrap()
            .contains("over this node's bound of 200 bytes"),
        "{kept}"
    );
}

/// A provider that gives every call the same id: each MCP call still has a
/// key of its own (`…#2` for the second), so a server that drops repeats
/// by key runs both; a retry that replays them sends neither again.
#[actix_rt::test]
async fn a_reused_tool_call_id_gives_each_mcp_call_its_own_key() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    env.provider.respond_with(|request, n| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let answers = messages.iter().filter(|m| m["role"] == "tool").count();
        let message = if answers >= 2 {
            json!({ "role": "assistant", "content": format!("done #{n}") })
        } else {
            let args = json!({ "order_id": format!("R{answers}"), "amount": 2 });
            crate::agent::tool_calls_message(&[("call_same", "mcp__shop__refund", args)])
        };
        crate::agent::chat_answer(request, n, message)
    });
    // The last turn fails once: its retry replays both calls from the
    // ledger, counting the reused id again as the first attempt did.
    env.provider.push(onceflow_engine::testkit::Behaviour::Ok);
    env.provider.push(onceflow_engine::testkit::Behaviour::Ok);
    env.provider
        .push(onceflow_engine::testkit::Behaviour::Status(500, None));
    let _engine = env.start(registry(servers(&[("shop", &shop)])), env.config());
    env.submit_job(job(&env, "reuse", json!({ "mcp": ["shop"] })))
        .await;
    let done = env.wait_for("reuse", JobState::Acked, WAIT).await;
    assert!(
        done.attempts >= 2,
        "the last turn was retried: {}",
        done.attempts
    );
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:reuse:tool:call_same", "job:reuse:tool:call_same#2"]
    );
}

/// A tool that may not run twice (no hints) and answers with an error may
/// have run partway: even when a fresh `tools/list` shows it withdrawn
/// meanwhile, it is not sent again (no `tool_unavailable` retry); the
/// model reads its error. The model's next call of it, now that the server
/// no longer lists it, is not sent at all: `tool_unavailable`, retried to
/// the budget. The server heard one call.
#[actix_rt::test]
async fn a_tool_that_may_not_run_twice_and_errs_is_never_sent_again() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    env.provider.respond_with(|request, n| {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let answers = messages.iter().filter(|m| m["role"] == "tool").count();
        let id = ["call_v", "call_w"];
        let message = match id.get(answers) {
            Some(id) => crate::agent::tool_calls_message(&[(
                id,
                "mcp__shop__void_invoice",
                json!({ "invoice_id": "I-7" }),
            )]),
            None => json!({ "role": "assistant", "content": format!("done #{n}") }),
        };
        crate::agent::chat_answer(request, n, message)
    });
    let _engine = env.start(registry(servers(&[("shop", &shop)])), env.config());
    env.submit_job(job(&env, "void", json!({ "mcp": ["shop"] })))
        .await;
    let dead = env.wait_for("void", JobState::Dead, WAIT).await;
    assert_eq!(dead.last_error.unwrap().code, "tool_unavailable");
    assert_eq!(shop.keys_of("void_invoice").await, ["job:void:tool:call_v"]);
    let answers = tool_answers(&env);
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert!(
        answers[0].starts_with("The tool reported an error"),
        "the model reads the tool's error: {answers:?}"
    );
}

/// An id submitted again after its job was purged is a new incarnation,
/// and its MCP calls carry that incarnation's keys (`job:{id}#2:…`): a
/// server that drops repeats by key runs the second life's call. A `#` in
/// the provider's call id is escaped, so it cannot pose as the n-th call
/// of another id.
#[actix_rt::test]
async fn a_purged_ids_next_life_keys_its_mcp_calls_anew() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script(
        &env,
        vec![(
            "call#2",
            "mcp__shop__refund",
            json!({ "order_id": "P1", "amount": 3 }),
        )],
    );
    let mut config = env.config();
    config.retention = Duration::from_secs(3600);
    let engine = env.start(registry(servers(&[("shop", &shop)])), config);
    env.submit_job(job(&env, "life", json!({ "mcp": ["shop"] })))
        .await;
    env.wait_for("life", JobState::Acked, WAIT).await;
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE id = 'life'")
        .await;
    engine.purge_now();
    let purged = wait_until(WAIT, || async {
        env.store.jobs().get("life").await.unwrap().is_none()
    })
    .await;
    assert!(purged, "the job was purged");
    let second = env
        .submit_job(job(&env, "life", json!({ "mcp": ["shop"] })))
        .await;
    assert_eq!(second.incarnation, 2);
    env.wait_for("life", JobState::Acked, WAIT).await;
    assert_eq!(
        shop.keys_of("refund").await,
        ["job:life:tool:call%232", "job:life#2:tool:call%232"]
    );
}

/// An approval list naming an MCP tool the job's servers do not list (a
/// typo: intake cannot know a server's tools) ends the job before any tool
/// runs, rather than letting the tool it meant run unasked.
#[actix_rt::test]
async fn an_approval_naming_no_pinned_mcp_tool_fails_closed() {
    let env = TestEnv::new().await;
    let shop = McpServer::counting().await;
    script(
        &env,
        vec![(
            "call_t",
            "mcp__shop__refund",
            json!({ "order_id": "T1", "amount": 9 }),
        )],
    );
    let _engine = env.start(registry(servers(&[("shop", &shop)])), env.config());
    let input = json!({ "mcp": ["shop"], "approval": ["mcp__shop__refnd"] });
    env.submit_job(job(&env, "typo", input)).await;
    let dead = env.wait_for("typo", JobState::Dead, WAIT).await;
    assert_eq!(dead.last_error.unwrap().code, "invalid_input");
    assert!(
        shop.keys_of("refund").await.is_empty(),
        "the refund never ran"
    );
    assert_eq!(env.provider.requests().len(), 0, "no model call was paid");
}
