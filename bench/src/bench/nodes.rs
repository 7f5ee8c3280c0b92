//! `bench --nodes N`: the saturating phase again with 1, 2, … N engine
//! processes on one database. Node 1 is this process (engine and API); each
//! further node is an `onceflow serve` child process on the same database
//! and the same loopback provider. Submissions go to each node's API in
//! turn, as behind a load balancer: a node runs what it accepts while it
//! has room (hand-off) and the nodes share the rest as deployed nodes do
//! (`FOR UPDATE SKIP LOCKED`, fenced leases). For each count it prints jobs/s, the ratio to
//! the commit limit, the per-job costs summed over every process, and how
//! the jobs were shared. On one small machine this shows what coordination
//! costs, not growth: the nodes share the cores the database needs.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;

use super::{costs, Env, Pacing, Phase};

/// A further engine node: an `onceflow serve` child process.
struct Node {
    child: Child,
    /// Its API, which takes its share of the submissions.
    base: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one node count measured.
struct Run {
    nodes: usize,
    phase: Phase,
    /// CPU (ms) of the further nodes' processes over the phase.
    others_cpu: f64,
    /// Jobs acked by each node, by node id.
    share: Vec<(String, i64)>,
}

/// Starts node `k` and waits until its API answers.
async fn start_node(
    k: usize,
    url: &str,
    provider: &str,
    max_in_flight: usize,
    pool: u32,
    log: &std::path::Path,
) -> anyhow::Result<Node> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let id = format!("bench-node-{k}");
    let log = std::fs::File::create(log)?;
    let child = Command::new(std::env::current_exe()?)
        .arg("serve")
        .env("DATABASE_URL", url)
        .env("OPENAI_BASE_URL", provider)
        .env("ONCEFLOW_NODE_ID", &id)
        .env("ONCEFLOW_LISTEN", format!("127.0.0.1:{port}"))
        // The webhook consumer is on loopback, as every fake here.
        .env("ONCEFLOW_ALLOW_PRIVATE_URLS", "true")
        .env("ONCEFLOW_MAX_IN_FLIGHT", max_in_flight.to_string())
        .env("ONCEFLOW_POLL_MS", "200")
        .env("ONCEFLOW_DB_POOL", pool.to_string())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting a node: onceflow serve")?;
    let node = Node {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    let health = format!("http://127.0.0.1:{port}/healthz");
    let started = Instant::now();
    loop {
        if let Ok(r) = reqwest::get(&health).await {
            if r.status().is_success() {
                return Ok(node);
            }
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "node {k} did not answer {health} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn cpu_ms(nodes: &[Node]) -> f64 {
    nodes
        .iter()
        .filter_map(|n| costs::proc_times(&n.child.id().to_string()))
        .map(|(_, own, _)| own as f64 * 1000.0 / costs::TICKS_PER_SEC)
        .sum()
}

/// Jobs of `pattern` acked by each node.
async fn share(env: &Env, pattern: &str) -> anyhow::Result<Vec<(String, i64)>> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        worker: String,
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = env.db.conn().await?;
    let rows: Vec<Row> = diesel::sql_query(
        "/* bench */ SELECT worker, count(*) AS n FROM job_history \
         WHERE state = 'acked' AND job_id LIKE $1 GROUP BY worker ORDER BY worker",
    )
    .bind::<Text, _>(pattern)
    .load(&mut conn)
    .await?;
    Ok(rows.into_iter().map(|r| (r.worker, r.n)).collect())
}

/// Runs the saturating phase with 1..=`max_nodes` nodes and prints a table.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run(
    env: &Env,
    run_id: &str,
    max_nodes: usize,
    jobs: usize,
    concurrency: usize,
    max_in_flight: usize,
    pool: u32,
    url: &str,
    limit: f64,
    data_dir: &std::path::Path,
) -> anyhow::Result<()> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut runs = Vec::new();
    for count in 1..=max_nodes {
        while nodes.len() + 1 < count {
            let k = nodes.len() + 2;
            let log = data_dir.join(format!("bench-node-{k}.log"));
            eprintln!("starting node {k} (onceflow serve, log {})…", log.display());
            nodes.push(
                start_node(k, url, &env.provider.base_url(), max_in_flight, pool, &log).await?,
            );
        }
        let mut env = env.clone();
        env.bases.extend(nodes.iter().map(|n| n.base.clone()));
        eprintln!(
            "{count} node(s): {jobs} jobs, {concurrency} concurrent clients, submitted to each node's API in turn…"
        );
        let prefix = format!("{run_id}-n{count}");
        let before = cpu_ms(&nodes);
        let phase = env
            .phase(&prefix, jobs, Pacing::Closed(concurrency))
            .await?;
        let others_cpu = cpu_ms(&nodes) - before;
        let share = share(&env, &format!("bench-{prefix}-%")).await?;
        runs.push(Run {
            nodes: count,
            phase,
            others_cpu,
            share,
        });
    }
    drop(nodes);

    println!();
    println!("onceflow-bench bench --nodes {max_nodes} — one database, commit limit {limit:.0} commits/s (pgbench)");
    print!("{:<38}", "");
    for r in &runs {
        print!(" {:>12}", format!("{} node(s)", r.nodes));
    }
    println!();
    let line = |name: &str, f: &dyn Fn(&Run) -> String| {
        print!("{name:<38}");
        for r in &runs {
            print!(" {:>12}", f(r));
        }
        println!();
    };
    let per_job = |r: &Run, x: f64| x / r.phase.jobs as f64;
    line("jobs/s", &|r| format!("{:.0}", r.phase.jobs_per_sec()));
    line("(jobs/s × checkpoints/job) ÷ limit", &|r| {
        let checkpoints = r.phase.checkpoints as f64 / r.phase.jobs as f64;
        format!("{:.3}", r.phase.jobs_per_sec() * checkpoints / limit)
    });
    line("p99 submit→webhook (ms)", &|r| {
        format!("{:.0}", r.phase.percentile(0.99).as_secs_f64() * 1e3)
    });
    line("statements per job", &|r| {
        r.phase.statements.as_ref().map_or("n/a".into(), |s| {
            format!("{:.2}", per_job(r, s.calls as f64))
        })
    });
    line("PostgreSQL execution ms per job", &|r| {
        r.phase
            .statements
            .as_ref()
            .map_or("n/a".into(), |s| format!("{:.2}", per_job(r, s.exec_ms)))
    });
    line("WAL flushes per job", &|r| {
        format!("{:.2}", per_job(r, r.phase.commits as f64))
    });
    line("CPU ms per job, node 1 (+ API, fakes)", &|r| {
        format!("{:.2}", per_job(r, r.phase.cpu.0))
    });
    line("CPU ms per job, further nodes", &|r| {
        format!("{:.2}", per_job(r, r.others_cpu))
    });
    line("CPU ms per job, PostgreSQL", &|r| {
        r.phase
            .cpu
            .1
            .map_or("n/a".into(), |c| format!("{:.2}", per_job(r, c)))
    });
    line("model requests, deliveries per job", &|r| {
        format!(
            "{:.2}, {:.2}",
            r.phase.model_requests as f64 / r.phase.jobs as f64,
            r.phase.deliveries as f64 / r.phase.jobs as f64
        )
    });
    line("jobs acked per node", &|r| {
        r.share
            .iter()
            .map(|(_, n)| n.to_string())
            .collect::<Vec<_>>()
            .join("/")
    });
    Ok(())
}
