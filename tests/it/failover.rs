//! Database failover: a primary and a synchronous streaming standby, two
//! real PostgreSQL clusters. `DATABASE_URL` names both hosts with
//! `target_session_attrs=read-write`; the primary is killed mid-run and the
//! standby promoted. The same node finishes every job, with the model's
//! work done once per job and each webhook processed once.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use onceflow_engine::node::intake::NewJob;
use onceflow_engine::pg::EmbeddedPg;
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::{Db, Engine, Registry, Store};
use serde_json::json;

/// A command run as the server's user (`postgres` when we are root).
fn as_server_user(program: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir("/")
        .env_remove("PGDATA")
        .env_remove("PGPORT");
    if nix::unistd::geteuid().is_root() {
        let user = nix::unistd::User::from_name("postgres")
            .unwrap()
            .expect("the postgres user");
        cmd.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    }
    cmd
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The standby's data directory, stopped and removed when dropped.
struct Standby {
    pg_ctl: PathBuf,
    root: PathBuf,
    data: PathBuf,
}

impl Drop for Standby {
    fn drop(&mut self) {
        let _ = as_server_user(&self.pg_ctl)
            .args(["stop", "-m", "immediate", "-D"])
            .arg(&self.data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

async fn execute(url: &str, sql: &str) {
    use diesel_async::{AsyncConnection, SimpleAsyncConnection};
    let mut conn = diesel_async::AsyncPgConnection::establish(url)
        .await
        .unwrap();
    conn.batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn query_i64(url: &str, sql: &str) -> i64 {
    use diesel_async::{AsyncConnection, RunQueryDsl};
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = diesel_async::AsyncPgConnection::establish(url)
        .await
        .unwrap();
    let row: N = diesel::sql_query(sql).get_result(&mut conn).await.unwrap();
    row.n
}

#[actix_rt::test]
async fn a_promoted_synchronous_standby_finishes_every_job_once() {
    // The primary: a throwaway cluster with the schema.
    let primary = EmbeddedPg::throwaway().expect("the primary");
    onceflow_engine::db::create_database(&primary.url("postgres"), "failover", None)
        .await
        .unwrap();
    Db::connect(&primary.url("failover"), 1)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();

    // The standby: a base backup of it, streaming (`-R`), on a port of its own.
    let root = tempfile::Builder::new()
        .prefix("onceflow-standby-")
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    let data = root.join("pg");
    std::fs::create_dir(&data).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).unwrap();
        if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres").unwrap().unwrap();
            nix::unistd::chown(&data, Some(user.uid), Some(user.gid)).unwrap();
        }
    }
    let standby = Standby {
        pg_ctl: primary.tool("pg_ctl").unwrap(),
        root,
        data,
    };
    let password = primary
        .url("x")
        .split_once("onceflow:")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map(|(pw, _)| pw.to_owned())
        .unwrap();
    let mut backup = as_server_user(&primary.tool("pg_basebackup").unwrap());
    backup
        .arg("-D")
        .arg(&standby.data)
        // A fast checkpoint: the default spreads it over minutes.
        .args(["-R", "-X", "stream", "-c", "fast", "-d"])
        .arg(format!(
            "host=127.0.0.1 port={} user=onceflow password={password}",
            primary.port()
        ));
    run(backup, "pg_basebackup");
    let port = crate::support::free_port();
    let mut start = as_server_user(&standby.pg_ctl);
    start
        .args(["start", "-w", "-t", "60", "-D"])
        .arg(&standby.data)
        .arg("-l")
        .arg(standby.data.join("server.log"))
        .arg("-o")
        .arg(format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c max_connections=200 -c fsync=off"
        ));
    run(start, "start the standby");
    let began = std::time::Instant::now();
    let admin = primary.url("postgres");
    assert!(
        wait_until(Duration::from_secs(30), || async {
            query_i64(
                &admin,
                "SELECT count(*) AS n FROM pg_stat_replication WHERE state = 'streaming'",
            )
            .await
                == 1
        })
        .await,
        "the standby streams"
    );
    // Synchronous: a commit returns once the standby has it (the role's
    // setting beats the throwaway server's `synchronous_commit=off`).
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
        "SELECT pg_reload_conf()",
        "ALTER ROLE onceflow SET synchronous_commit = 'on'",
    ] {
        execute(&admin, sql).await;
    }
    assert!(
        wait_until(Duration::from_secs(10), || async {
            query_i64(
                &admin,
                "SELECT count(*) AS n FROM pg_stat_replication WHERE sync_state = 'sync'",
            )
            .await
                == 1
        })
        .await
    );

    // A node on both hosts.
    let url = format!(
        "postgres://onceflow:{password}@127.0.0.1:{},127.0.0.1:{port}/failover?target_session_attrs=read-write",
        primary.port()
    );
    let env = TestEnv::new().await; // its fakes and test timings
    env.provider.set_latency(Duration::from_millis(500));
    let store = Store::new(Db::connect(&url, 8).await.unwrap());
    let mut registry = Registry::new();
    registry.register(onceflow_workflows::Completion::default());
    let mut config = env.config();
    config.max_in_flight = 4;
    let engine = Engine::start(store.clone(), registry, env.faults.clone(), config);
    let ids: Vec<String> = (0..60).map(|i| format!("fo-{i}")).collect();
    for id in &ids {
        store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(&NewJob {
                tags: Default::default(),
                id: id.clone(),
                workflow: "completion".into(),
                workflow_version: 1,
                input: json!({"model": "m", "messages": [{"role": "user", "content": id}]}),
                webhook_url: env.consumer.url(),
                schedule: Default::default(),
            }))
            .await
            .unwrap();
    }
    // Counted on the standby itself, not through the node's pool: a
    // broken failover fails here in 90 s instead of waiting on the pool.
    let standby_url = format!("postgres://onceflow:{password}@127.0.0.1:{port}/failover");
    let acked = || async {
        query_i64(
            &standby_url,
            "SELECT count(*) AS n FROM jobs WHERE state = 'acked'",
        )
        .await
    };
    assert!(
        wait_until(Duration::from_secs(30), || async {
            env.consumer.delivery_count() >= 8
        })
        .await,
        "some jobs finished before the failover"
    );

    eprintln!(
        "standby streaming and first jobs done after {:?}",
        began.elapsed()
    );
    // The primary dies mid-run (jobs still unfinished); the standby is promoted.
    let before = acked().await;
    assert!(
        before < 60,
        "the failover must come mid-run: {before} of 60 acked"
    );
    primary.crash().unwrap();
    let mut promote = as_server_user(&standby.pg_ctl);
    promote.args(["promote", "-w", "-D"]).arg(&standby.data);
    run(promote, "promote the standby");

    let all = wait_until(Duration::from_secs(90), || async { acked().await == 60 }).await;
    eprintln!(
        "every job acked {:?} after the standby started",
        began.elapsed()
    );
    assert!(all, "{} of 60 acked after the failover", acked().await);
    engine.shutdown();
    tokio::time::sleep(Duration::from_millis(500)).await;
    crate::support::assert_model_work_once_per_job(&env.provider, &ids);
    for id in &ids {
        assert_eq!(env.consumer.processed_for(id), 1, "{id}");
        let key = format!("job:{id}:completed");
        assert_eq!(
            env.consumer.requests_with_key(&key),
            env.consumer.deliveries_for(id).len(),
            "{id}: every request under its one key"
        );
        assert!(
            env.consumer.deliveries_for(id).len() <= 2,
            "{id}: at most one send in flight at the crash repeated"
        );
    }
    // The promoted standby holds every job and history: nothing committed
    // on the primary was lost.
    assert_eq!(
        query_i64(
            &url,
            "SELECT count(*) AS n FROM job_history WHERE state = 'acked'"
        )
        .await,
        60
    );
}
