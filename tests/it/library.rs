//! onceflow as a library: a crate of a user's own (`examples/greet`, its own
//! workspace, onceflow by path) builds `--locked` and serves its workflow.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onceflow_engine::testkit::{wait_until, TestEnv};
use serde_json::json;

use crate::support::{free_port, get, post_job, ServeProcess};

/// `target/debug/greet`, built now if it is not there yet (`.ci/run` builds
/// it before the tests; the build reuses this target directory).
fn greet_binary() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let binary = target.join("debug/greet");
    if !binary.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--locked", "--manifest-path"])
            .arg(root.join("examples/greet/Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .expect("cargo");
        assert!(status.success(), "examples/greet does not build");
    }
    binary
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
    let delivery = &env.consumer.deliveries_for("greet-1")[0];
    assert!(delivery.body["result"]["greeting"]
        .as_str()
        .unwrap()
        .contains("Ada"));
}
