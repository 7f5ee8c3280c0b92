//! The real `onceflow serve` binary: the embedded PostgreSQL is reused across
//! runs, and jobs survive SIGKILL.

use std::collections::HashSet;
use std::time::Duration;

use onceflow_engine::testkit::{database, wait_until, Behaviour, FakeConsumer, FakeProvider};
use serde_json::{json, Value};

use crate::support::{alive, get, post_job, postmaster_pid, ServeProcess, StopPostgresOnDrop};

fn job(id: &str, hook: &str) -> Value {
    json!({
        "id": id,
        "workflow": "completion",
        "input": { "model": "m", "messages": [{ "role": "user", "content": format!("prompt {id}") }] },
        "webhook_url": hook,
    })
}

#[actix_rt::test]
async fn the_embedded_postgres_is_reused_across_runs_and_after_sigkill() {
    // A world-traversable temp folder: the server may run as `postgres`.
    let dir = tempfile::Builder::new()
        .prefix("onceflow-it-")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("data");
    let _cleanup = StopPostgresOnDrop(data.clone());
    let log = dir.path().join("serve.log");
    let provider = FakeProvider::start();
    let consumer = FakeConsumer::start();
    let env = [
        ("ONCEFLOW_DATA_DIR", data.display().to_string()),
        ("OPENAI_BASE_URL", provider.base_url()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
    ];

    // First run: initialise, take a job to acked, then SIGKILL.
    let mut first = ServeProcess::start(&env, &log).await;
    let (status, _) = post_job(&first.base, &job("keep-1", &consumer.url())).await;
    assert_eq!(status, 201);
    let url = format!("{}/v1/jobs/keep-1", first.base);
    assert!(
        wait_until(Duration::from_secs(20), || async {
            get(&url).await.1["state"] == "acked"
        })
        .await
    );
    let pg_pid = postmaster_pid(&data).expect("postmaster.pid");
    // The application connects as a role that is not a superuser.
    let roles = app_roles(&data).await;
    assert!(!roles.is_empty(), "serve has connections open");
    assert!(
        roles
            .iter()
            .all(|(name, superuser)| name == "onceflow_app" && !superuser),
        "{roles:?}"
    );
    first.sigkill();
    assert!(alive(pg_pid), "PostgreSQL outlives a SIGKILLed serve");

    // Second run adopts the running server: same data.
    let mut second = ServeProcess::start(&env, &log).await;
    assert_eq!(
        postmaster_pid(&data),
        Some(pg_pid),
        "the running server was adopted, not replaced"
    );
    let (status, stored) = get(&format!("{}/v1/jobs/keep-1", second.base)).await;
    assert_eq!(status, 200);
    assert_eq!(stored["state"], "acked");
    let (status, _) = post_job(&second.base, &job("keep-1", &consumer.url())).await;
    assert_eq!(
        status, 200,
        "an identical resubmission finds the stored job"
    );
    second.sigkill();

    // The server crashes too (SIGKILL of the postmaster): the next run recovers.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pg_pid),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || async { !alive(pg_pid) }).await);
    let mut third = ServeProcess::start(&env, &log).await;
    let (status, stored) = get(&format!("{}/v1/jobs/keep-1", third.base)).await;
    assert_eq!(status, 200);
    assert_eq!(stored["state"], "acked");
    assert_eq!(consumer.processed_for("keep-1"), 1);
    assert_eq!(provider.work_done("job:keep-1:generate"), 1);

    // A graceful stop stops the embedded server too.
    let status = third.sigterm();
    assert!(status.success(), "serve exits cleanly on SIGTERM: {status}");
    assert!(
        postmaster_pid(&data).is_none(),
        "the embedded PostgreSQL was stopped"
    );
}

#[actix_rt::test]
async fn a_hundred_jobs_survive_two_sigkills_of_serve() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let db_url = database::fresh().await;
    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(40));
    let consumer = FakeConsumer::start();
    // A few failures on the way, so retries are in flight when we kill.
    consumer.push(Behaviour::Status(503, None));
    provider.push(Behaviour::Status(500, None));
    let env = [
        ("DATABASE_URL", db_url),
        ("OPENAI_BASE_URL", provider.base_url()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
        ("ONCEFLOW_POLL_MS", "100".to_owned()),
        ("ONCEFLOW_RETRY_BASE_MS", "20".to_owned()),
        ("ONCEFLOW_MAX_IN_FLIGHT", "20".to_owned()),
    ];
    let ids: Vec<String> = (0..100).map(|i| format!("kill-{i:03}")).collect();
    let t0 = std::time::Instant::now();
    let mut serve = ServeProcess::start(&env, &log).await;
    for id in &ids {
        let (status, answer) = post_job(&serve.base, &job(id, &consumer.url())).await;
        assert_eq!(status, 201, "{answer}");
    }
    for round in 0..2 {
        // Kill while work is under way.
        let target = 20 * (round + 1);
        assert!(
            wait_until(Duration::from_secs(30), || async {
                provider.total_work() >= target
            })
            .await,
            "no progress before kill {round}"
        );
        eprintln!("SIGKILL {round} after {:?}", t0.elapsed());
        serve.sigkill();
        serve = ServeProcess::start(&env, &log).await;
    }
    let base = serve.base.clone();
    let all_acked = wait_until(Duration::from_secs(90), || async {
        let mut done = 0;
        for id in &ids {
            if get(&format!("{base}/v1/jobs/{id}")).await.1["state"] == "acked" {
                done += 1;
            }
        }
        done == ids.len()
    })
    .await;
    assert!(
        all_acked,
        "not every job was acked; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    for id in &ids {
        let key = format!("job:{id}:completed");
        let deliveries = consumer.deliveries_for(id);
        let keys: HashSet<_> = deliveries.iter().map(|d| d.webhook_id.clone()).collect();
        assert_eq!(keys.len(), 1, "one distinct delivery key for {id}");
        assert!(keys.contains(&Some(key)), "{id}: {keys:?}");
        assert_eq!(consumer.processed_for(id), 1, "{id} processed once");
        assert_eq!(
            provider.work_done(&format!("job:{id}:generate")),
            1,
            "{id}: model work done once"
        );
    }
    assert!(provider.keys_worked_twice().is_empty());
    crate::support::assert_model_work_once_per_job(&provider, &ids);
    let raw_repeats = consumer.deliveries().iter().filter(|d| d.duplicate).count();
    println!("100 jobs, 2 SIGKILLs: {raw_repeats} repeated webhook requests (same key, dropped by the consumer)");
}

/// The roles (and whether each is a superuser) of the connections to the
/// `onceflow` database, read as the embedded server's superuser.
async fn app_roles(data: &std::path::Path) -> Vec<(String, bool)> {
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct Role {
        #[diesel(sql_type = diesel::sql_types::Text)]
        rolname: String,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        rolsuper: bool,
    }
    let password = std::fs::read_to_string(data.join("pg.password")).unwrap();
    let pid_file = std::fs::read_to_string(data.join("pg/postmaster.pid")).unwrap();
    let port = pid_file.lines().nth(3).unwrap().trim();
    let url = format!(
        "postgres://onceflow:{}@127.0.0.1:{port}/postgres",
        password.trim()
    );
    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
    let rows: Vec<Role> = diesel::sql_query(
        "SELECT r.rolname::text AS rolname, r.rolsuper FROM pg_stat_activity a \
         JOIN pg_roles r ON r.oid = a.usesysid WHERE a.datname = 'onceflow'",
    )
    .load(&mut conn)
    .await
    .unwrap();
    rows.into_iter().map(|r| (r.rolname, r.rolsuper)).collect()
}

/// Two nodes on one data directory: a second node under the first one's
/// ONCEFLOW_NODE_ID refuses to start, saying why; a second node under its
/// own name runs, and stopping it leaves the first node's embedded
/// PostgreSQL (which it did not start) running.
/// Starts `serve` with `vars`, expects it to refuse to run (exit non-zero
/// within 30 s) and returns what it said on stderr.
async fn refused_twin(vars: &[(&str, String)]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"));
    cmd.arg("serve")
        .env_remove("DATABASE_URL")
        .env(
            "ONCEFLOW_LISTEN",
            format!("127.0.0.1:{}", crate::support::free_port()),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let twin = cmd.spawn().unwrap();
    let pid = twin.id() as i32;
    let exited = wait_until(Duration::from_secs(30), || async {
        !alive(pid)
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z "))
    })
    .await;
    if !exited {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
    let twin = twin.wait_with_output().unwrap();
    assert!(exited, "the twin must not run");
    assert!(!twin.status.success(), "the twin must not run");
    String::from_utf8_lossy(&twin.stderr).into_owned()
}

#[actix_rt::test]
async fn a_second_node_on_one_data_dir_neither_shares_a_name_nor_stops_the_database() {
    let dir = tempfile::Builder::new()
        .prefix("onceflow-it-")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("data");
    let _cleanup = StopPostgresOnDrop(data.clone());
    let log = dir.path().join("serve.log");
    let node = |name: &str| {
        [
            ("ONCEFLOW_DATA_DIR", data.display().to_string()),
            ("ONCEFLOW_NODE_ID", name.to_owned()),
        ]
    };
    let first = ServeProcess::start(&node("node-one"), &log).await;
    let said = refused_twin(&node("node-one")).await;
    assert!(
        said.contains("ONCEFLOW_NODE_ID") && said.contains("node-one"),
        "{said}"
    );
    let healthz = format!("{}/healthz", first.base);
    assert_eq!(get(&healthz).await.0, 200, "the twin left the database up");

    let mut second = ServeProcess::start(&node("node-two"), &log).await;
    assert!(second.sigterm().success());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        get(&healthz).await.0,
        200,
        "the second node stopped the first one's PostgreSQL on its way out"
    );
}

/// The backend holding node name `name`'s advisory lock, if any.
async fn name_holder(env: &onceflow_engine::testkit::TestEnv, name: &str) -> Option<i64> {
    env.sql(&format!(
        "SELECT pid::bigint AS pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND classid = 7310586 AND objid = hashtext('{name}')::oid"
    ))
    .await
    .as_array()
    .unwrap()
    .first()
    .map(|r| r["pid"].as_i64().unwrap())
}

/// The connection that holds a node's name drops (its backend terminated,
/// as in a database restart). The node takes its name again, so a twin
/// started afterwards still refuses to run. And when a twin slips in while
/// the connection is down, the node that finds its name taken stops, with
/// a message naming ONCEFLOW_NODE_ID, rather than share it.
#[actix_rt::test]
async fn a_node_keeps_its_name_across_a_dropped_connection_or_stops() {
    let env = onceflow_engine::testkit::TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = |name: &str, lease_ms: u64| {
        vec![
            ("DATABASE_URL", env.db_url.clone()),
            ("ONCEFLOW_NODE_ID", name.to_owned()),
            ("ONCEFLOW_LEASE_MS", lease_ms.to_string()),
        ]
    };
    // Checked every second: the name is taken again on a new connection.
    let _kept = ServeProcess::start(&vars("kept", 1000), &log).await;
    let before = name_holder(&env, "kept").await.expect("the name is held");
    env.execute(&format!("SELECT pg_terminate_backend({before})"))
        .await;
    let retaken = wait_until(Duration::from_secs(15), || async {
        name_holder(&env, "kept")
            .await
            .is_some_and(|pid| pid != before)
    })
    .await;
    assert!(retaken, "the node took its name again on a new connection");
    let said = refused_twin(&vars("kept", 1000)).await;
    assert!(said.contains("ONCEFLOW_NODE_ID"), "{said}");

    // Checked every 4 s: a twin starts while the name is free, and the
    // node, finding it taken at three checks in a row, stops.
    let mut lost = ServeProcess::start(&vars("lost", 4000), &log).await;
    let before = name_holder(&env, "lost").await.expect("the name is held");
    env.execute(&format!("SELECT pg_terminate_backend({before})"))
        .await;
    let _twin = ServeProcess::start(&vars("lost", 4000), &log).await;
    let pid = lost.child.id() as i32;
    let stopped = wait_until(Duration::from_secs(30), || async {
        !alive(pid)
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z "))
    })
    .await;
    assert!(stopped, "the node whose name was taken stopped");
    assert!(!lost.child.wait().unwrap().success());
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("another node took the name") && logged.contains("ONCEFLOW_NODE_ID"),
        "{logged}"
    );
}
