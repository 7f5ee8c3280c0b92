//! onceflow as a library: a crate of a user's own (`examples/greet`, its own
//! workspace, onceflow by path) builds `--locked` and serves its workflow.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onceflow_engine::testkit::{wait_until, TestEnv};
use serde_json::json;

use crate::support::{free_port, get, post_job, ServeProcess};

/// `target/debug/greet` (`.ci/run` builds it before the tests; this build is
/// then a no-op, and it reuses this target directory either way).
fn greet_binary() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    // Built (or found up to date) every time, so it is never a stale binary.
    let status = Command::new(env!("CARGO"))
        .args(["build", "--locked", "--manifest-path"])
        .arg(root.join("examples/greet/Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .expect("cargo");
    assert!(status.success(), "examples/greet does not build");
    target.join("debug/greet")
}

#[actix_rt::test]
async fn a_users_own_crate_builds_and_serves_its_workflow() {
    let binary = greet_binary();
    let help = Command::new(&binary).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for command in ["serve", "submit", "status", "jobs", "token", "redrive"] {
        assert!(help.contains(command), "the same command line: {help}");
    }

    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start_binary(
        &binary,
        free_port(),
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
        ],
        &dir.path().join("greet.log"),
    )
    .await;
    let (status, body) = post_job(
        &serve.base,
        &json!({ "id": "greet-1", "workflow": "greet", "input": { "name": "Ada" },
                 "webhook_url": env.consumer.url() }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    // The built-ins are there too.
    let (status, body) = post_job(
        &serve.base,
        &json!({ "id": "plain-1", "workflow": "completion", "webhook_url": env.consumer.url(),
                 "input": { "model": "m", "messages": [{ "role": "user", "content": "hi" }] } }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let acked = wait_until(Duration::from_secs(20), || async {
        get(&format!("{}/v1/jobs/greet-1", serve.base)).await.1["state"] == "acked"
    })
    .await;
    assert!(
        acked,
        "{}",
        std::fs::read_to_string(dir.path().join("greet.log")).unwrap_or_default()
    );
    assert_eq!(env.provider.requests_for("job:greet-1:greet"), 1);
    // The guide's walk-through (docs/guide/workflows.md): the same binary's `submit --input` and `status`.
    let submit = Command::new(&binary)
        .args(["submit", "--id", "greet-cli", "--workflow", "greet"])
        .args(["--input", r#"{"name": "Bo"}"#, "--webhook-url"])
        .arg(env.consumer.url())
        .args(["--server", &serve.base])
        .output()
        .unwrap();
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );
    assert!(String::from_utf8_lossy(&submit.stdout).contains("job greet-cli created"));
    let status_says_acked = wait_until(Duration::from_secs(20), || async {
        let out = Command::new(&binary)
            .args(["status", "greet-cli", "--server", &serve.base])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("acked")
    })
    .await;
    assert!(status_says_acked, "`greet status greet-cli` shows it acked");
    assert_eq!(env.provider.requests_for("job:greet-cli:greet"), 1);
    assert_eq!(env.consumer.processed_for("greet-cli"), 1);
    let delivery = &env.consumer.deliveries_for("greet-1")[0];
    assert!(delivery.body["data"]["result"]["greeting"]
        .as_str()
        .unwrap()
        .contains("Ada"));
}

/// `onceflow::Client`: a job of a workflow type submitted with its typed
/// input and read back with its typed output; every API error typed.
#[actix_rt::test]
async fn the_typed_client_submits_reads_and_maps_errors() {
    use onceflow::{Client, ClientError};
    use onceflow_workflows::completion::{CompletionInput, CompletionOutput, Message, Role};
    use onceflow_workflows::Completion;
    let env = TestEnv::new().await;
    let mut registry = onceflow_engine::Registry::new();
    registry.register(Completion::default());
    let base = crate::support::serve_api(&env, registry.clone(), None);
    let _engine = env.start(registry, env.config());
    let client = Client::new(&base);
    let input = CompletionInput {
        model: "m".into(),
        messages: vec![Message {
            role: Role::User,
            content: "typed".into(),
        }],
        temperature: None,
        max_tokens: None,
        provider: Default::default(),
        stream: false,
    };
    let submitted = client
        .submit::<Completion>("typed-1", &input, &env.consumer.url())
        .await
        .unwrap();
    assert!(submitted.created);
    let again = client
        .submit::<Completion>("typed-1", &input, &env.consumer.url())
        .await
        .unwrap();
    assert!(!again.created, "an identical resubmission is 200");
    let done = wait_until(Duration::from_secs(20), || async {
        client
            .job::<CompletionOutput>("typed-1")
            .await
            .is_ok_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(done);
    let job = client.job::<CompletionOutput>("typed-1").await.unwrap();
    assert!(job.result.unwrap().content.starts_with("echo: typed"));
    assert_eq!(job.history.len(), 6);
    let page = client.list(&onceflow::ListQuery::default()).await.unwrap();
    assert_eq!(page.jobs.len(), 1);

    // Typed errors.
    let mut other = input.clone();
    other.model = "other".into();
    match client
        .submit::<Completion>("typed-1", &other, &env.consumer.url())
        .await
    {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "conflict"),
        other => panic!("{other:?}"),
    }
    match client
        .submit::<Completion>("bad id!", &input, &env.consumer.url())
        .await
    {
        Err(ClientError::Invalid { field, .. }) => assert_eq!(field, "id"),
        other => panic!("{other:?}"),
    }
    match client.job::<CompletionOutput>("nobody").await {
        Err(ClientError::NotFound(_)) => {}
        other => panic!("{other:?}"),
    }
    match client.redrive("typed-1", "x", false).await {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "not_dead"),
        other => panic!("{other:?}"),
    }
    // A full backlog: 429 with its Retry-After.
    let full = crate::support::serve_api_state(onceflow_engine::api::ApiState {
        store: env.store.clone(),
        registry: {
            let mut r = onceflow_engine::Registry::new();
            r.register(Completion::default());
            r
        },
        body_limit: onceflow_engine::api::DEFAULT_BODY_LIMIT,
        telemetry: std::sync::Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        hosts: onceflow_engine::api::Hosts::Any,
        auth: onceflow_engine::api::Auth::Off,
        limits: onceflow_engine::api::Bounds::backlog(0, 0),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
    });
    match Client::new(full)
        .submit::<Completion>("typed-2", &input, &env.consumer.url())
        .await
    {
        Err(ClientError::RateLimited { retry_after, .. }) => {
            assert_eq!(retry_after, Some(Duration::from_secs(5)))
        }
        other => panic!("{other:?}"),
    }
}

/// Every Rust block in the README and in `docs/` is code CI builds: it is
/// marked `<!-- verbatim: PATH -->` and found, character for character, in
/// that file (the example crate's library, binary, client and explorer
/// test), so no snippet can drift from code that compiles.
#[test]
fn every_rust_block_in_the_docs_is_code_ci_builds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    let mut checked = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let name = page.strip_prefix(root).unwrap().display().to_string();
        for (at, _) in text.match_indices("```rust") {
            let before = text[..at].trim_end();
            let marker = before
                .rsplit('\n')
                .next()
                .and_then(|l| l.strip_prefix("<!-- verbatim: "))
                .and_then(|l| l.strip_suffix(" -->"))
                .unwrap_or_else(|| {
                    panic!("{name}: a Rust block without a <!-- verbatim: PATH --> line above it")
                });
            let rest = &text[at..];
            let start = rest.find('\n').unwrap() + 1;
            let block = &rest[start..start + rest[start..].find("```").unwrap()];
            let file = std::fs::read_to_string(root.join(marker))
                .unwrap_or_else(|e| panic!("{name}: {marker}: {e}"));
            assert!(
                file.contains(block),
                "{name}: the block marked {marker} is not in that file:\n{block}"
            );
            checked.push(format!("{name} <- {marker}"));
        }
    }
    // The walk-through (lib, main, explorer test), the client, and the
    // explorer in the testing guide.
    assert!(checked.len() >= 5, "{checked:#?}");
}

/// A user workflow under a built-in's name is refused at registration,
/// whatever its version: a higher version would silently replace the
/// built-in `agent` for every new job.
#[test]
fn a_workflow_under_a_built_in_name_is_refused() {
    struct MyAgent;
    impl onceflow::Workflow for MyAgent {
        const NAME: &'static str = "agent";
        const VERSION: u32 = 7;
        type Input = serde_json::Value;
        type Output = serde_json::Value;
        async fn run(
            &self,
            _: &mut onceflow::Context,
            input: serde_json::Value,
        ) -> Result<serde_json::Value, onceflow::StepError> {
            Ok(input)
        }
    }
    let refused = std::panic::catch_unwind(|| {
        let _ = onceflow::App::new().workflow(MyAgent);
    });
    let message = *refused
        .expect_err("a workflow named agent must be refused")
        .downcast::<String>()
        .unwrap();
    assert!(
        message.contains("\"agent\"") && message.contains("built-in"),
        "{message}"
    );
}

/// `onceflow::Client::signal`: recorded now (`true`), the identical signal
/// again (`false`), and every refusal typed with the API's code or field.
#[actix_rt::test]
async fn the_typed_client_sends_a_signal_once_and_maps_its_refusals() {
    use onceflow::{Client, ClientError};
    let env = TestEnv::new().await;
    let mut registry = onceflow_engine::Registry::new();
    registry.register(onceflow_workflows::Completion::default());
    let base = crate::support::serve_api(&env, registry, None);
    let client = Client::new(&base);
    let job = json!({
        "id": "sig-1", "workflow": "completion", "webhook_url": env.consumer.url(),
        "input": { "model": "m", "messages": [{ "role": "user", "content": "hi" }] },
        "delay_ms": 3_600_000,
    });
    let (status, body) = post_job(&base, &job).await;
    assert_eq!(status, 201, "{body}");
    let payload = json!({ "approved": true });
    assert!(client.signal("sig-1", "go", "s-1", &payload).await.unwrap());
    assert!(!client.signal("sig-1", "go", "s-1", &payload).await.unwrap());
    match client.signal("sig-1", "go", "s-1", &json!(2)).await {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "signal_conflict"),
        other => panic!("another payload under the same id: {other:?}"),
    }
    // Path segments are encoded: `a?b` is a bad name, not the name `a`
    // with a query.
    match client.signal("sig-1", "a?b", "s-2", &payload).await {
        Err(ClientError::Invalid { field, .. }) => assert_eq!(field, "name"),
        other => panic!("a bad name: {other:?}"),
    }
    assert!(client
        .signal("sig-1", "approval:c-1", "s-4", &payload)
        .await
        .unwrap());
    match client.signal("nobody", "go", "s-1", &payload).await {
        Err(ClientError::NotFound(_)) => {}
        other => panic!("an unknown job: {other:?}"),
    }
    env.store
        .jobs()
        .cancel("sig-1", "test", "done")
        .await
        .unwrap();
    match client.signal("sig-1", "go", "s-3", &payload).await {
        Err(ClientError::Conflict { code, .. }) => assert_eq!(code, "job_finished"),
        other => panic!("a finished job: {other:?}"),
    }
    let signals = env.job("sig-1").await.signals;
    let names: Vec<(&str, &str)> = signals
        .iter()
        .map(|s| (s.name.as_str(), s.id.as_str()))
        .collect();
    assert_eq!(
        names,
        [("go", "s-1"), ("approval:c-1", "s-4")],
        "recorded once each"
    );
}
