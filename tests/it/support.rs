//! Shared helpers: the real HTTP API in-process, and the real binary as a child.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use onceflow_engine::api::{self, ApiState, DEFAULT_BODY_LIMIT};
use onceflow_engine::testkit::TestEnv;
use onceflow_engine::Registry;
use serde_json::Value;

/// Serves the API on 127.0.0.1:0 inside the current actix System; returns its base URL.
pub fn serve_api(env: &TestEnv, registry: Registry, body_limit: Option<usize>) -> String {
    serve_api_state(api_state(env, registry, body_limit, None))
}

/// Serves the API with `auth` (tokens, or open).
pub fn serve_api_with_auth(
    env: &TestEnv,
    registry: Registry,
    auth: onceflow_engine::api::Auth,
) -> String {
    let mut state = api_state(env, registry, None, None);
    state.auth = auth;
    serve_api_state(state)
}

/// Serves the API of a node that runs `engine` too: a new job it has room
/// for is handed to it in intake's commit, as `serve` does.
pub fn serve_node_api(
    env: &TestEnv,
    registry: Registry,
    engine: &onceflow_engine::Engine,
) -> String {
    serve_api_state(api_state(env, registry, None, Some(engine.handoff())))
}

/// The API's state for tests: open (no tokens), private URLs allowed, the
/// test's store and hub (shared with the engines `env.start` starts).
fn api_state(
    env: &TestEnv,
    registry: Registry,
    body_limit: Option<usize>,
    handoff: Option<onceflow_engine::node::handoff::Handoff>,
) -> ApiState {
    ApiState {
        store: env.store.clone(),
        registry,
        body_limit: body_limit.unwrap_or(DEFAULT_BODY_LIMIT),
        telemetry: std::sync::Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        hosts: onceflow_engine::api::Hosts::Any,
        auth: onceflow_engine::api::Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff,
        hub: env.hub.clone(),
    }
}

/// Serves the API with this state (e.g. an engine's telemetry).
pub fn serve_api_state(state: ApiState) -> String {
    serve_api_for(|_| state)
}

/// Serves the API with the state `make` builds for its address (e.g. a
/// `Host` list naming that address).
pub fn serve_api_for(make: impl FnOnce(std::net::SocketAddr) -> ApiState) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let state = make(addr);
    let server = actix_web::HttpServer::new(move || {
        actix_web::App::new().configure(api::configure(state.clone()))
    })
    .workers(1)
    .disable_signals()
    .listen(listener)
    .unwrap()
    .run();
    actix_web::rt::spawn(server);
    format!("http://{addr}")
}

/// One HTTP client for every test (building one loads the system's CA store, which is slow).
pub fn client() -> &'static reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    // A pooled connection idle for long is dropped well before the server's
    // keep-alive (5 s) would close it: reusing one just as the server closes
    // it fails the request (`IncompleteMessage`).
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .pool_idle_timeout(std::time::Duration::from_millis(1500))
            .build()
            .expect("an HTTP client")
    })
}

/// POSTs raw bytes to `/v1/jobs`; returns the status and the JSON answer.
pub async fn post_raw(base: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let response = client()
        .post(format!("{base}/v1/jobs"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("POST /v1/jobs");
    let status = response.status().as_u16();
    let value = response.json().await.unwrap_or(Value::Null);
    (status, value)
}

pub async fn post_job(base: &str, body: &Value) -> (u16, Value) {
    post_raw(base, serde_json::to_vec(body).unwrap()).await
}

pub async fn get(url: &str) -> (u16, Value) {
    let response = client().get(url).send().await.expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The body of a GET as text (`/metrics`).
pub async fn get_text(url: &str) -> String {
    let response = client().get(url).send().await.expect("GET");
    response.text().await.expect("a text body")
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `serve` could not bind its port: another process took it first.
#[derive(Debug)]
struct PortTaken;

fn read_log(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// The real `onceflow serve`, killed when dropped.
pub struct ServeProcess {
    pub child: Child,
    pub base: String,
}

impl ServeProcess {
    /// Starts `onceflow serve` with `env` and waits until `/healthz` answers 200.
    /// A port taken by another test between `free_port()` and the bind is
    /// tried again on another one.
    pub async fn start(env: &[(&str, String)], log: &Path) -> ServeProcess {
        let binary = Path::new(env!("CARGO_BIN_EXE_onceflow"));
        for _ in 0..4 {
            match Self::try_start(binary, free_port(), env, log).await {
                Ok(serve) => return serve,
                Err(PortTaken) => continue,
            }
        }
        panic!("four free ports were taken before onceflow serve bound them");
    }

    /// Starts a new server on this one's port (after it was killed).
    pub async fn restart_on_same_port(&mut self, env: &[(&str, String)], log: &Path) {
        let port: u16 = self.base.rsplit(':').next().unwrap().parse().unwrap();
        *self = Self::start_on(port, env, log).await;
    }

    pub async fn start_on(port: u16, env: &[(&str, String)], log: &Path) -> ServeProcess {
        Self::start_binary(Path::new(env!("CARGO_BIN_EXE_onceflow")), port, env, log).await
    }

    /// Starts `serve` of another binary built on onceflow (a user's crate).
    pub async fn start_binary(
        binary: &Path,
        port: u16,
        env: &[(&str, String)],
        log: &Path,
    ) -> ServeProcess {
        match Self::try_start(binary, port, env, log).await {
            Ok(serve) => serve,
            Err(PortTaken) => panic!("port {port} is taken; log:\n{}", read_log(log)),
        }
    }

    async fn try_start(
        binary: &Path,
        port: u16,
        env: &[(&str, String)],
        log: &Path,
    ) -> Result<ServeProcess, PortTaken> {
        let logged_before = std::fs::metadata(log).map_or(0, |m| m.len() as usize);
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut cmd = Command::new(binary);
        cmd.arg("serve")
            .env_remove("DATABASE_URL")
            // The fakes live on loopback; one test checks the default refuses them.
            .env("ONCEFLOW_ALLOW_PRIVATE_URLS", "true")
            .env("ONCEFLOW_LISTEN", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn onceflow serve");
        let base = format!("http://127.0.0.1:{port}");
        let mut serve = ServeProcess { child, base };
        let healthz = format!("{}/healthz", serve.base);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = serve.child.try_wait() {
                let said = read_log(log);
                if said
                    .get(logged_before..)
                    .unwrap_or("")
                    .contains("Address already in use")
                {
                    return Err(PortTaken);
                }
                panic!("onceflow serve exited early: {status}; log:\n{said}");
            }
            let healthy = client()
                .get(&healthz)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            // Healthy and still ours (a server of another test could answer
            // on a port we failed to take).
            if healthy && matches!(serve.child.try_wait(), Ok(None)) {
                return Ok(serve);
            }
            if std::time::Instant::now() > deadline {
                let _ = serve.child.kill();
                panic!(
                    "onceflow serve did not become healthy; log:\n{}",
                    read_log(log)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn sigkill(&mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::SIGKILL,
        )
        .unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::SIGTERM,
        )
        .unwrap();
        self.child.wait().unwrap()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pid in a data directory's `postmaster.pid`, if the file exists.
pub fn postmaster_pid(data_dir: &Path) -> Option<i32> {
    std::fs::read_to_string(data_dir.join("pg/postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

pub fn alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Stops an embedded server left running in `data_dir` (test clean-up).
pub struct StopPostgresOnDrop(pub std::path::PathBuf);

impl Drop for StopPostgresOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = postmaster_pid(&self.0) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGQUIT);
        }
    }
}

/// Every model request the provider received was under one of the jobs'
/// `job:{id}:generate` keys, and the work was done once per job in all:
/// work under any other key (or none) would be a second bill for a job.
pub fn assert_model_work_once_per_job(
    provider: &onceflow_engine::testkit::FakeProvider,
    ids: &[String],
) {
    let expected: std::collections::HashSet<String> =
        ids.iter().map(|id| format!("job:{id}:generate")).collect();
    let strays: Vec<_> = provider
        .requests()
        .iter()
        .filter(|r| {
            !r.idempotency_key
                .as_ref()
                .is_some_and(|k| expected.contains(k))
        })
        .map(|r| r.idempotency_key.clone())
        .collect();
    assert!(
        strays.is_empty(),
        "model requests under no job's key: {strays:?}"
    );
    assert_eq!(
        provider.total_work(),
        ids.len() as u64,
        "model work once per job, in all"
    );
}
