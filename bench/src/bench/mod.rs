//! `onceflow-bench bench`: N jobs end to end through the real HTTP API, against a
//! provider and a webhook consumer on loopback, on a durable PostgreSQL.
//!
//! Phase 1 submits as fast as `--concurrency` clients can (the maximum
//! throughput); phase 2 submits at half that rate, open loop, to measure
//! latency at a sustainable load. Before the engine starts, the same run
//! measures the server's durable commit limit the way the field does
//! (pgbench: one-row INSERT commits over independent connections, at 16 and
//! at 64 clients), so the figures hold on a noisy machine: the ratio
//! (jobs/s × checkpoints per job) ÷ the best of the two; it measures the
//! same again right after phase 1, to show how far that denominator moved
//! while the engine ran. It also prints what
//! each job costs ([`costs`]): statements, PostgreSQL execution time, WAL
//! flushes, and CPU time of this process (and, of it, the fake provider's
//! and consumer's threads) and of the server; and what the machine did
//! meanwhile: how busy its cores were, how much of their time the
//! hypervisor stole, and a fixed workload's time before and after.

mod costs;
mod curve;
mod fairness;
mod nodes;
mod streams;
mod waits;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use diesel::sql_types::BigInt;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use onceflow_engine::api::{self, ApiState};
use onceflow_engine::testkit::{FakeConsumer, FakeProvider};
use onceflow_engine::{db, Db, Engine, EngineConfig, Faults, Store};
use serde_json::json;

use onceflow::config::DbArgs;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Jobs in the saturating phase (the paced phase runs half as many).
    #[arg(long, default_value_t = 2000)]
    pub jobs: usize,
    /// Jobs run at the maximum before phase 1 and not counted, so the pool's
    /// connections have prepared and planned their statements as a running
    /// engine's have (0: none; the two-phase run only, not the modes below).
    #[arg(long, default_value_t = 1000)]
    pub warmup: usize,
    /// Concurrent submitting clients in the saturating phase.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Latency of the fake model provider, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub model_latency_ms: u64,
    /// Jobs the engine runs at once.
    #[arg(long, default_value_t = 1000)]
    pub max_in_flight: usize,
    /// Pace the second phase at this many jobs/s instead of half the measured maximum.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Before the paced phase's counted jobs, submit `rate × ms / 1000` more
    /// at the same rate, with no pause before the counted ones. Their
    /// latencies are printed on their own line (and with the counted ones'
    /// as a whole) and left out of the phase's p50/p99 and stage table, so
    /// that the steady rate is reported apart from the step up from idle
    /// that follows the statistics wait; their work is in the per-job
    /// costs. 0 disables.
    #[arg(long, default_value_t = 1000)]
    pub lead_in_ms: u64,
    /// Scale mode: hold all `--jobs` in flight at once (the provider runs in a
    /// child process) and report peak memory and lease-renewal load.
    #[arg(long)]
    pub hold: bool,
    /// Talk HTTP/1.1 to the loopback provider (one connection per in-flight
    /// call) instead of h2c (all calls on one HTTP/2 connection).
    #[arg(long)]
    pub provider_http1: bool,
    /// Limit mode: the learned provider window over time, against a fake
    /// provider that answers 429 above this many concurrent calls, with no
    /// limit configured, on two engine nodes (`--jobs` jobs).
    #[arg(long, value_name = "CONCURRENCY")]
    pub limit_curve: Option<usize>,
    /// What waiting costs: N jobs sleeping at once (RSS, idle statements),
    /// then `--timers` timers due in the same second.
    #[arg(long, value_name = "N")]
    pub waiting: Option<usize>,
    /// Fairness between tenants: the acquire statement's time at 1, 100
    /// and 1,000 tokens and with 100,000 concurrency keys (beside the
    /// statement before fairness), and another tenant's time to its first
    /// start behind a backlog of 10,000.
    #[arg(long)]
    pub fairness: bool,
    /// With `--waiting`: timers due in the same second.
    #[arg(long, default_value_t = 10_000)]
    pub timers: usize,
    /// Streaming mode: this many streamed completions at once, each watched
    /// over `GET /v1/jobs/{id}/events`; prints the delay each chunk takes
    /// from the provider to a watcher (journaled first).
    #[arg(long, value_name = "N")]
    pub streams: Option<usize>,
    /// Streaming mode: chunks per answer.
    #[arg(long, default_value_t = 200)]
    pub stream_chunks: usize,
    /// Streaming mode: the streams start spread over this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub stream_ramp_ms: u64,
    /// Streaming mode: milliseconds between chunks (on average).
    #[arg(long, default_value_t = 25)]
    pub stream_interval_ms: u64,
    /// Streaming mode: every stream sends its chunks in lockstep (the worst
    /// case: all chunks of all streams arrive at once) instead of each gap
    /// drawn from 0.5–1.5 × the interval, as a model's pace varies.
    #[arg(long)]
    pub stream_aligned: bool,
    /// Scale-out mode: the saturating phase with 1, 2, … N engine nodes on
    /// one database (node 1 this process, the others `onceflow serve`
    /// children); prints jobs/s and per-job costs per node count.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
    pub nodes: Option<u16>,
    /// Lease length in milliseconds (the heartbeat renews every third of it).
    #[arg(long, env = "ONCEFLOW_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,
}

/// `onceflow fake-provider` (hidden): the loopback provider and webhook
/// consumer as a process of their own, so `bench --hold` measures the
/// engine's memory alone.
#[derive(Debug, Args)]
pub struct FakeProviderArgs {
    /// Latency of every call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
}

/// Serves a fake provider and consumer, prints the provider's base URL and
/// the webhook URL (a line each), and exits when stdin closes.
pub fn fake_provider(args: FakeProviderArgs) -> anyhow::Result<()> {
    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(args.latency_ms));
    let consumer = FakeConsumer::start();
    println!("{}", provider.base_url());
    println!("{}", consumer.url());
    let mut sink = String::new();
    while std::io::stdin().read_line(&mut sink)? > 0 {}
    Ok(())
}

/// This process's peak resident memory (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

struct Phase {
    /// Every job the phase ran, the lead-in's included: per-job costs and
    /// jobs/s are over these.
    jobs: usize,
    /// Of them, the paced phase's lead-in, left out of [`Phase::latencies`].
    lead: usize,
    lead_latencies: Vec<Duration>,
    /// CPU used during the phase (ms): this process, the server.
    cpu: (f64, Option<f64>),
    /// Of this process's, the fake provider's and consumer's (ms).
    fakes_cpu: Option<f64>,
    /// The machine's cores during the phase: % busy, % stolen by the hypervisor.
    machine: Option<(f64, f64)>,
    /// `pg_stat_statements` over the phase, when the server loads it.
    statements: Option<costs::Statements>,
    elapsed: Duration,
    latencies: Vec<Duration>,
    checkpoints: i64,
    /// WAL flushes (fsyncs) during the phase; several commits may share one.
    commits: i64,
    /// Row and WAL work during the phase.
    rows: Counters,
    model_requests: usize,
    deliveries: usize,
}

impl Phase {
    fn jobs_per_sec(&self) -> f64 {
        self.jobs as f64 / self.elapsed.as_secs_f64()
    }
    fn percentile(&self, p: f64) -> Duration {
        percentile(&self.latencies, p)
    }
}

fn percentile(latencies: &[Duration], p: f64) -> Duration {
    let mut l = latencies.to_vec();
    l.sort();
    l.get(((l.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let database = args.db.resolve()?;
    // The same OTEL_* variables as `serve`, so export cost can be measured.
    let telemetry = std::sync::Arc::new(
        onceflow_observability::Telemetry::from_env().context("OpenTelemetry configuration")?,
    );
    if let Some(otlp) = telemetry.otlp() {
        eprintln!(
            "exporting OpenTelemetry over OTLP/HTTP (traces {}, metrics {})",
            otlp.traces.as_deref().unwrap_or("off"),
            otlp.metrics.as_deref().unwrap_or("off")
        );
    }
    let result = actix_web::rt::System::new().block_on(bench(&args, &database, &telemetry));
    if telemetry.otlp().is_some() {
        if let Err(e) = telemetry.shutdown() {
            eprintln!("could not flush telemetry: {e}");
        }
    }
    if let Some(pg) = database.embedded.as_ref().filter(|pg| pg.started_here()) {
        let _ = pg.stop();
    }
    result
}

async fn bench(
    args: &BenchArgs,
    database: &onceflow::config::Database,
    telemetry: &std::sync::Arc<onceflow_observability::Telemetry>,
) -> anyhow::Result<()> {
    // A database of its own on the embedded server; the given one otherwise.
    let url = match &database.embedded {
        Some(pg) => {
            let name = format!("bench_{}", std::process::id());
            db::create_database(&pg.url("postgres"), &name, None).await?;
            // Planning time per statement, for this database's sessions only
            // (the embedded server preloads `pg_stat_statements`).
            let planning = async {
                use diesel_async::{AsyncConnection, AsyncPgConnection};
                let mut admin = AsyncPgConnection::establish(&pg.url("postgres")).await?;
                admin
                    .batch_execute(&format!(
                        "ALTER DATABASE {name} SET pg_stat_statements.track_planning = on"
                    ))
                    .await?;
                anyhow::Ok(())
            };
            if let Err(e) = planning.await {
                eprintln!("planning time is not tracked: {e}");
            }
            pg.url(&name)
        }
        None => database.url.clone(),
    };
    let pool = args.db.db_pool.max(4);
    let db = Db::connect(&url, pool).await.context("connecting")?;
    db.migrate().await?;
    let run_id = format!("{:x}", chrono::Utc::now().timestamp_millis());

    if args.hold {
        return hold(args, db, &run_id, telemetry).await;
    }
    if let Some(n) = args.streams {
        return streams::run(args, db, &run_id, n).await;
    }
    if let Some(n) = args.waiting {
        let result = waits::run(args, db.clone(), &run_id, n, args.timers).await;
        let store = Store::new(db.clone());
        drop_bench_database(database, db, store, &url).await?;
        return result;
    }
    if args.fairness {
        let result = fairness::run(args, db.clone()).await;
        let store = Store::new(db.clone());
        drop_bench_database(database, db, store, &url).await?;
        return result;
    }
    if let Some(limit) = args.limit_curve {
        return curve::run(args, db, &run_id, limit).await;
    }

    eprintln!("gauging the cores' speed (fixed single-thread work, best of five)…");
    let gauge_before = tokio::task::spawn_blocking(costs::cpu_gauge_ms).await?;
    eprintln!("  {gauge_before:.1} ms");
    // The commit limit, before anything else runs: pgbench at 16 and 64
    // clients (the best is the denominator), and the pooled probe earlier
    // versions printed (through this process's own pool, for comparison).
    costs::create_commit_table(&db).await?;
    let pgbench_tool = costs::find_pgbench(database.embedded.as_ref());
    let pgbench = match &pgbench_tool {
        Some(tool) => pgbench_rates(tool, &url, "the commit limit").await?,
        None => {
            eprintln!("pgbench not found: the ratio uses the pooled probe only");
            Vec::new()
        }
    };
    eprintln!("measuring the pooled single-row commit rate ({pool} connections, 3 s)…");
    let commit_rate = commit_rate(&db, pool as usize, Duration::from_secs(3)).await?;
    eprintln!("  {commit_rate:.0} commits/s");
    costs::drop_commit_table(&db).await?;
    let limit = best_rate(&pgbench).unwrap_or(commit_rate);
    let stat_statements = costs::reset_statements(&db).await;
    if !stat_statements {
        eprintln!("pg_stat_statements is not loaded: no per-statement figures");
    }
    let postmaster = database
        .embedded
        .as_ref()
        .and_then(|pg| pg.postmaster_pid());

    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(args.model_latency_ms));
    let consumer = FakeConsumer::start();
    let store = Store::new(db.clone());
    let registry = onceflow_workflows::registry();
    // The loopback consumer is the only private address webhooks may reach.
    let guard = onceflow_engine::UrlGuard::strict().allowing_url(&consumer.url());
    let mut config = EngineConfig {
        node_id: "bench-node-1".to_owned(),
        max_in_flight: args.max_in_flight,
        poll_interval: Duration::from_millis(200),
        telemetry: telemetry.clone(),
        url_guard: guard.clone(),
        ..EngineConfig::default()
    };
    config.provider.base_url = provider.base_url();
    let telemetry = config.telemetry.clone();
    let engine = Engine::start(store.clone(), registry.clone(), Faults::new(), config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let base = format!("http://{}", listener.local_addr()?);
    let state = ApiState {
        store: store.clone(),
        registry,
        body_limit: api::DEFAULT_BODY_LIMIT,
        telemetry,
        url_guard: guard,
        hosts: api::Hosts::Any,
        auth: api::Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: Some(engine.handoff()),
        hub: engine.hub(),
    };
    let server = actix_web::HttpServer::new(move || {
        actix_web::App::new().configure(api::configure(state.clone()))
    })
    .workers(1)
    .disable_signals()
    .listen(listener)?
    .run();
    let server_handle = server.handle();
    actix_web::rt::spawn(server);

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    let env = Env {
        client,
        bases: vec![base],
        hook: consumer.url(),
        db: db.clone(),
        provider: provider.clone(),
        consumer: consumer.clone(),
        stat_statements,
        postmaster,
    };

    if let Some(n) = args.nodes {
        let data_dir = args.db.data_dir.clone();
        std::fs::create_dir_all(&data_dir)?;
        let result = nodes::run(
            &env,
            &run_id,
            usize::from(n),
            args.jobs,
            args.concurrency,
            args.max_in_flight,
            pool,
            &url,
            limit,
            &data_dir,
        )
        .await;
        engine.shutdown();
        server_handle.stop(true).await;
        drop(env);
        drop_bench_database(database, db, store, &url).await?;
        return result;
    }

    if args.warmup > 0 {
        eprintln!(
            "warm-up: {} jobs, {} concurrent clients, not counted…",
            args.warmup, args.concurrency
        );
        env.phase(
            &format!("{run_id}-warmup"),
            args.warmup,
            Pacing::Closed(args.concurrency),
        )
        .await?;
    }
    eprintln!(
        "phase 1: {} jobs, {} concurrent clients…",
        args.jobs, args.concurrency
    );
    let max = env
        .phase(
            &format!("{run_id}-max"),
            args.jobs,
            Pacing::Closed(args.concurrency),
        )
        .await?;
    // The same measurement again right after phase 1: the VM's fsync rate
    // moves by the minute, so the run shows how far its denominator moved
    // while the engine ran (the ratio itself stays against the reading
    // taken before the engine started, as documented).
    let pgbench_after = match &pgbench_tool {
        Some(tool) => {
            costs::create_commit_table(&db).await?;
            let rates = pgbench_rates(tool, &url, "the commit limit again, after phase 1").await?;
            costs::drop_commit_table(&db).await?;
            rates
        }
        None => Vec::new(),
    };
    let rate = args.rate.unwrap_or(max.jobs_per_sec() / 2.0).max(1.0);
    let paced_jobs = (args.jobs / 2).max(1);
    let lead_in = if args.lead_in_ms > 0 {
        format!(", after a lead-in of {} ms", args.lead_in_ms)
    } else {
        String::new()
    };
    eprintln!("phase 2: {paced_jobs} jobs paced at {rate:.0} jobs/s{lead_in}…");
    let paced = env
        .phase(
            &format!("{run_id}-paced"),
            paced_jobs,
            Pacing::Open {
                rate,
                lead: (rate * args.lead_in_ms as f64 / 1000.0).round() as usize,
            },
        )
        .await?;

    engine.shutdown();
    server_handle.stop(true).await;
    eprintln!("gauging the cores' speed again…");
    let gauge_after = tokio::task::spawn_blocking(costs::cpu_gauge_ms).await?;

    println!();
    println!(
        "onceflow-bench bench — model latency {} ms, durable PostgreSQL",
        args.model_latency_ms
    );
    if args.warmup > 0 {
        println!(
            "(after a warm-up of {} jobs at the maximum, not counted)",
            args.warmup
        );
    }
    if paced.lead > 0 {
        println!(
            "(paced p50 / p99 and stage times: the counted jobs, after a lead-in of {} jobs \
             at the same rate, shown apart)",
            paced.lead
        );
    }
    println!(
        "(cores' speed: a fixed single-thread workload took {gauge_before:.1} ms before the \
         phases and {gauge_after:.1} ms after; lower is faster)"
    );
    println!("{:<34} {:>14} {:>14}", "", "max (closed)", "paced (open)");
    let row = |name: &str, a: String, b: String| println!("{name:<34} {a:>14} {b:>14}");
    row("jobs", max.jobs.to_string(), paced.jobs.to_string());
    row(
        "  of which lead-in (see below)",
        max.lead.to_string(),
        paced.lead.to_string(),
    );
    row(
        "jobs/s",
        format!("{:.1}", max.jobs_per_sec()),
        format!("{:.1}", paced.jobs_per_sec()),
    );
    for (label, p) in [
        ("p50 submit→webhook (ms)", 0.5),
        ("p99 submit→webhook (ms)", 0.99),
    ] {
        row(
            label,
            format!("{:.1}", max.percentile(p).as_secs_f64() * 1e3),
            format!("{:.1}", paced.percentile(p).as_secs_f64() * 1e3),
        );
    }
    if paced.lead > 0 {
        let ms = |l: &[Duration], p| percentile(l, p).as_secs_f64() * 1e3;
        row(
            "  lead-in p50 / p99 (ms)",
            String::new(),
            format!(
                "{:.1} / {:.1}",
                ms(&paced.lead_latencies, 0.5),
                ms(&paced.lead_latencies, 0.99)
            ),
        );
        let all: Vec<Duration> = paced
            .latencies
            .iter()
            .chain(&paced.lead_latencies)
            .copied()
            .collect();
        row(
            "  lead-in and counted p50 / p99",
            String::new(),
            format!("{:.1} / {:.1}", ms(&all, 0.5), ms(&all, 0.99)),
        );
    }
    for (label, f) in [
        (
            "checkpoints/s",
            (|p: &Phase| p.checkpoints as f64 / p.elapsed.as_secs_f64()) as fn(&Phase) -> f64,
        ),
        ("checkpoints per job", |p: &Phase| {
            p.checkpoints as f64 / p.jobs as f64
        }),
        ("WAL flushes (fsync) per job", |p: &Phase| {
            p.commits as f64 / p.jobs as f64
        }),
        ("WAL kB per job", |p: &Phase| {
            p.rows.wal_bytes as f64 / 1024.0 / p.jobs as f64
        }),
        ("rows inserted per job", |p: &Phase| {
            p.rows.rows_inserted as f64 / p.jobs as f64
        }),
        ("rows updated per job", |p: &Phase| {
            p.rows.rows_updated as f64 / p.jobs as f64
        }),
        ("  of which HOT (no index write)", |p: &Phase| {
            p.rows.rows_hot as f64 / p.jobs as f64
        }),
        ("model requests per job", |p: &Phase| {
            p.model_requests as f64 / p.jobs as f64
        }),
        ("deliveries per job", |p: &Phase| {
            p.deliveries as f64 / p.jobs as f64
        }),
    ] {
        row(
            label,
            format!("{:.2}", f(&max)),
            format!("{:.2}", f(&paced)),
        );
    }
    let per_job = |p: &Phase, x: f64| x / p.jobs as f64;
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"));
    let pct = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.1}"));
    row(
        "statements (round trips) per job",
        opt(max
            .statements
            .as_ref()
            .map(|s| per_job(&max, s.calls as f64))),
        opt(paced
            .statements
            .as_ref()
            .map(|s| per_job(&paced, s.calls as f64))),
    );
    row(
        "PostgreSQL execution ms per job",
        opt(max.statements.as_ref().map(|s| per_job(&max, s.exec_ms))),
        opt(paced
            .statements
            .as_ref()
            .map(|s| per_job(&paced, s.exec_ms))),
    );
    row(
        "PostgreSQL planning ms per job",
        opt(max
            .statements
            .as_ref()
            .and_then(|s| s.plan_ms)
            .map(|ms| per_job(&max, ms))),
        opt(paced
            .statements
            .as_ref()
            .and_then(|s| s.plan_ms)
            .map(|ms| per_job(&paced, ms))),
    );
    row(
        "CPU ms per job, this process",
        format!("{:.2}", per_job(&max, max.cpu.0)),
        format!("{:.2}", per_job(&paced, paced.cpu.0)),
    );
    row(
        "  of which fake provider + consumer",
        opt(max.fakes_cpu.map(|c| per_job(&max, c))),
        opt(paced.fakes_cpu.map(|c| per_job(&paced, c))),
    );
    row(
        "CPU ms per job, PostgreSQL",
        opt(max.cpu.1.map(|c| per_job(&max, c))),
        opt(paced.cpu.1.map(|c| per_job(&paced, c))),
    );
    row(
        "cores busy, % of all",
        pct(max.machine.map(|m| m.0)),
        pct(paced.machine.map(|m| m.0)),
    );
    row(
        "  of which stolen by the hypervisor",
        pct(max.machine.map(|m| m.1)),
        pct(paced.machine.map(|m| m.1)),
    );
    let checkpoint_rate = |p: &Phase| p.jobs_per_sec() * (p.checkpoints as f64 / p.jobs as f64);
    for (clients, rate) in &pgbench {
        row(
            &format!("commit limit, pgbench {clients} clients"),
            format!("{rate:.0}"),
            String::new(),
        );
    }
    for (clients, rate) in &pgbench_after {
        row(
            &format!("  again after phase 1, {clients} clients"),
            format!("{rate:.0}"),
            String::new(),
        );
    }
    row(
        "pooled commit probe (earlier figure)",
        format!("{commit_rate:.0}"),
        String::new(),
    );
    row(
        "(jobs/s × checkpoints/job) ÷ limit",
        // Three decimals: 0.499 is under the 0.5 target, and must not print as 0.50.
        format!("{:.3}", checkpoint_rate(&max) / limit),
        format!("{:.3}", checkpoint_rate(&paced) / limit),
    );
    if let Some(after) = best_rate(&pgbench_after) {
        row(
            "  ÷ the limit after phase 1",
            format!("{:.3}", checkpoint_rate(&max) / after),
            String::new(),
        );
    }
    row(
        "  ÷ pooled probe (earlier figure)",
        format!("{:.2}", checkpoint_rate(&max) / commit_rate),
        format!("{:.2}", checkpoint_rate(&paced) / commit_rate),
    );
    for (name, phase) in [("phase 1", &max), ("phase 2", &paced)] {
        let Some(s) = &phase.statements else { continue };
        println!();
        println!(
            "costliest statements, {name} (calls per job, execution ms per call, planning ms \
             per call, total execution ms):"
        );
        for (calls, ms, plan_ms, query) in &s.top {
            let per_call = |ms: f64| ms / (*calls).max(1) as f64;
            println!(
                "  {:>5.2} {:>7.3} {:>7} {:>8.0}  {}",
                *calls as f64 / phase.jobs as f64,
                per_call(*ms),
                plan_ms.map_or("n/a".into(), |p| format!("{:.3}", per_call(p))),
                ms,
                costs::one_line(query, 80)
            );
        }
    }

    println!();
    println!(
        "time between checkpoints (p50 / p99 ms; a stage ends when the batch journaling its end ran):"
    );
    println!("{:<38} {:>16} {:>16}", "", "max (closed)", "paced (open)");
    let (max_stages, paced_stages) = (
        costs::stages(&db, &format!("bench-{run_id}-max-%")).await?,
        costs::stages(&db, &format!("bench-{run_id}-paced-%")).await?,
    );
    let cell = |s: Option<(f64, f64)>| {
        s.map_or_else(
            || "n/a".to_owned(),
            |(p50, p99)| format!("{p50:.1} / {p99:.1}"),
        )
    };
    for ((name, a), b) in costs::STAGES.iter().zip(max_stages).zip(paced_stages) {
        println!("  {name:<36} {:>16} {:>16}", cell(a), cell(b));
    }

    drop(env);
    print_row_work(&db, args.warmup + max.jobs + paced.jobs).await?;
    drop_bench_database(database, db, store, &url).await
}

/// Rows written per job by table over the whole run: where the index
/// writes go (an update that is not HOT writes an entry in every index).
async fn print_row_work(db: &Db, jobs: usize) -> anyhow::Result<()> {
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
        #[diesel(sql_type = BigInt)]
        indexes: i64,
        #[diesel(sql_type = BigInt)]
        ins: i64,
        #[diesel(sql_type = BigInt)]
        upd: i64,
        #[diesel(sql_type = BigInt)]
        hot: i64,
    }
    // Read after the last phase's counters settled.
    let mut conn = db.conn().await?;
    let _ = conn.batch_execute("SELECT pg_stat_clear_snapshot()").await;
    let tables: Vec<Table> = diesel::sql_query(
        "/* bench */ SELECT t.relname::text AS name, \
         (SELECT count(*) FROM pg_index i WHERE i.indrelid = t.relid) AS indexes, \
         t.n_tup_ins AS ins, t.n_tup_upd AS upd, t.n_tup_hot_upd AS hot \
         FROM pg_stat_user_tables t \
         WHERE t.relname NOT IN ('bench_commits', '__diesel_schema_migrations') AND t.n_tup_ins + t.n_tup_upd > 0 \
         ORDER BY t.n_tup_ins + t.n_tup_upd DESC",
    )
    .load(&mut conn)
    .await?;
    println!();
    println!(
        "rows per job by table, warm-up and both phases (inserted, updated, of which HOT, \
         indexes):"
    );
    let per_job = |n: i64| n as f64 / jobs.max(1) as f64;
    for t in tables {
        println!(
            "  {:<28} {:>6.2} {:>6.2} {:>6.2} {:>4}",
            t.name,
            per_job(t.ins),
            per_job(t.upd),
            per_job(t.hot),
            t.indexes
        );
    }
    Ok(())
}

/// Drops the bench's own database on the embedded server.
async fn drop_bench_database(
    database: &onceflow::config::Database,
    db: Db,
    store: Store,
    url: &str,
) -> anyhow::Result<()> {
    if let Some(pg) = &database.embedded {
        drop(db);
        drop(store);
        let name = url.rsplit('/').next().unwrap_or_default().to_owned();
        let mut admin =
            <diesel_async::AsyncPgConnection as diesel_async::AsyncConnection>::establish(
                &pg.url("postgres"),
            )
            .await?;
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
    Ok(())
}

/// pgbench's one-row INSERT commits/s at 16 and at 64 clients, in turn.
async fn pgbench_rates(
    tool: &std::path::Path,
    url: &str,
    what: &str,
) -> anyhow::Result<Vec<(u32, f64)>> {
    let mut rates = Vec::new();
    for clients in [16, 64] {
        eprintln!(
            "measuring {what}: pgbench, one-row INSERT commits, {clients} clients, {} s…",
            costs::PGBENCH_TIME.as_secs()
        );
        let tool = tool.to_owned();
        let url = url.to_owned();
        let rate = tokio::task::spawn_blocking(move || {
            costs::pgbench_rate(&tool, &url, clients, costs::PGBENCH_TIME.as_secs() as u32)
        })
        .await??;
        eprintln!("  {rate:.0} commits/s");
        rates.push((clients, rate));
    }
    Ok(rates)
}

/// The best of pgbench's rates (the denominator), if it ran.
fn best_rate(rates: &[(u32, f64)]) -> Option<f64> {
    rates.iter().map(|&(_, r)| r).reduce(f64::max)
}

enum Pacing {
    /// This many clients, each submitting its next job as soon as the last is accepted.
    Closed(usize),
    /// Submissions started at this rate (jobs/s), whatever the answers take;
    /// the first `lead` of them are a lead-in, left out of the latencies.
    Open { rate: f64, lead: usize },
}

#[derive(Clone)]
struct Env {
    client: reqwest::Client,
    /// The API of each node jobs are submitted to, in turn.
    bases: Vec<String>,
    hook: String,
    db: Db,
    provider: FakeProvider,
    consumer: FakeConsumer,
    /// Whether the server loads `pg_stat_statements`.
    stat_statements: bool,
    /// The embedded server's postmaster, for its CPU time.
    postmaster: Option<u32>,
}

impl Env {
    async fn phase(&self, prefix: &str, jobs: usize, pacing: Pacing) -> anyhow::Result<Phase> {
        if self.stat_statements {
            costs::reset_statements(&self.db).await;
        }
        let before = counters(&self.db).await?;
        let cpu_before = costs::cpu_now(self.postmaster);
        let machine_before = costs::machine_ticks();
        let requests_before = self.provider.requests().len();
        let deliveries_before = self.consumer.deliveries().len();
        let lead = match pacing {
            Pacing::Open { lead, .. } => lead,
            Pacing::Closed(_) => 0,
        };
        let lead_prefix = format!("bench-{prefix}{}", costs::LEAD_IN_TAG);
        let ids: Vec<String> = (0..lead)
            .map(|i| format!("{lead_prefix}{i}"))
            .chain((0..jobs).map(|i| format!("bench-{prefix}-{i}")))
            .collect();
        let jobs = ids.len();
        let submitted: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
            Default::default();
        let failures = Arc::new(AtomicU64::new(0));
        let wal_start = wal_position(&self.db).await?;
        let start = Instant::now();
        // Spread over the nodes' APIs, as a load balancer would (`--nodes`).
        let next_api = std::sync::atomic::AtomicUsize::new(0);
        let submit = |id: String| {
            let client = self.client.clone();
            let api = next_api.fetch_add(1, Ordering::Relaxed) % self.bases.len();
            let url = format!("{}/v1/jobs", self.bases[api]);
            let hook = self.hook.clone();
            let submitted = submitted.clone();
            let failures = failures.clone();
            async move {
                let body = json!({
                    "id": id, "workflow": "completion", "webhook_url": hook,
                    "input": { "model": "bench", "messages": [{ "role": "user", "content": "hi" }] },
                });
                submitted
                    .lock()
                    .expect("lock")
                    .insert(id.clone(), Instant::now());
                match client.post(&url).json(&body).send().await {
                    Ok(r) if r.status().as_u16() == 201 => {}
                    _ => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        };
        match pacing {
            Pacing::Closed(clients) => {
                let queue = Arc::new(std::sync::Mutex::new(ids.clone()));
                let workers = (0..clients).map(|_| {
                    let queue = queue.clone();
                    let submit = &submit;
                    async move {
                        loop {
                            // Not in the `while let`: the guard must not live across the await.
                            let next = queue.lock().expect("lock").pop();
                            let Some(id) = next else { break };
                            submit(id).await;
                        }
                    }
                });
                let submitting = futures_util::future::join_all(workers);
                let progress = self.progress(prefix, jobs, start, deliveries_before);
                let (_, done) = tokio::join!(submitting, progress);
                done?;
            }
            Pacing::Open { rate, .. } => {
                let interval = Duration::from_secs_f64(1.0 / rate);
                let mut tasks = Vec::with_capacity(jobs);
                for (i, id) in ids.iter().enumerate() {
                    let due = start + interval.mul_f64(i as f64);
                    tokio::time::sleep_until(due.into()).await;
                    tasks.push(actix_web::rt::spawn(submit(id.clone())));
                }
                for t in tasks {
                    let _ = t.await;
                }
                self.progress(prefix, jobs, start, deliveries_before)
                    .await?;
            }
        }
        let elapsed = start.elapsed();
        let cpu_after = costs::cpu_now(self.postmaster);
        let machine_after = costs::machine_ticks();
        let wal_bytes = wal_position(&self.db).await? - wal_start;
        let statements = if self.stat_statements {
            Some(costs::read_statements(&self.db).await?)
        } else {
            None
        };
        let failed = AtomicU64::load(&failures, Ordering::Relaxed);
        anyhow::ensure!(
            failed == 0,
            "{failed} submissions were not accepted with 201"
        );
        let mut after = counters(&self.db).await? - before;
        after.wal_bytes = wal_bytes;
        let submitted = submitted.lock().expect("lock");
        let deliveries = self.consumer.deliveries();
        let (mut latencies, mut lead_latencies) = (Vec::with_capacity(jobs), Vec::new());
        for d in &deliveries[deliveries_before..] {
            let id = d.body["data"]["job_id"].as_str().unwrap_or_default();
            if let Some(t0) = submitted.get(id) {
                let took = d.received_at.saturating_duration_since(*t0);
                if id.starts_with(&lead_prefix) {
                    lead_latencies.push(took);
                } else {
                    latencies.push(took);
                }
            }
        }
        Ok(Phase {
            jobs,
            lead,
            lead_latencies,
            cpu: (
                cpu_after.this_process - cpu_before.this_process,
                cpu_after
                    .postgres
                    .zip(cpu_before.postgres)
                    .map(|(a, b)| a - b),
            ),
            fakes_cpu: cpu_after.fakes.zip(cpu_before.fakes).map(|(a, b)| a - b),
            machine: machine_after
                .zip(machine_before)
                .and_then(|(a, b)| a.since(&b)),
            statements,
            elapsed,
            latencies,
            checkpoints: after.checkpoints,
            commits: after.wal_syncs,
            rows: after,
            model_requests: self.provider.requests().len() - requests_before,
            deliveries: deliveries.len() - deliveries_before,
        })
    }

    /// Waits until every job of the phase is acked, printing progress each
    /// second. Counts the consumer's deliveries (in memory) until all have
    /// arrived, and only then asks the database, so watching costs the
    /// server nothing while the jobs run.
    async fn progress(
        &self,
        prefix: &str,
        jobs: usize,
        start: Instant,
        deliveries_before: usize,
    ) -> anyhow::Result<()> {
        let pattern = format!("bench-{prefix}-%");
        let mut last_print = Instant::now();
        loop {
            let delivered = self.consumer.delivery_count() - deliveries_before;
            if delivered >= jobs {
                let acked = acked(&self.db, &pattern).await?;
                if acked >= jobs as i64 {
                    eprintln!(
                        "  {acked}/{jobs} acked in {:.1} s",
                        start.elapsed().as_secs_f64()
                    );
                    return Ok(());
                }
            }
            if last_print.elapsed() >= Duration::from_secs(1) {
                eprintln!(
                    "  {delivered}/{jobs} delivered after {:.1} s",
                    start.elapsed().as_secs_f64()
                );
                last_print = Instant::now();
            }
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(600),
                "jobs did not finish within 10 minutes"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn acked(db: &Db, pattern: &str) -> anyhow::Result<i64> {
    let mut conn = db.conn().await?;
    let c: Count = diesel::sql_query(
        "/* bench */ SELECT count(*) AS n FROM jobs WHERE state = 'acked' AND id LIKE $1",
    )
    .bind::<diesel::sql_types::Text, _>(pattern)
    .get_result(&mut conn)
    .await?;
    Ok(c.n)
}

/// Server-wide counters read before and after a phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counters {
    /// History rows: one per checkpoint.
    checkpoints: i64,
    /// WAL flushes to disk of the whole server.
    wal_syncs: i64,
    /// WAL written during the phase, from the WAL position itself (exact, no
    /// statistics lag); set by the phase, not by [`counters`].
    wal_bytes: i64,
    /// Rows inserted and updated in the engine's tables, and how many of
    /// the updates were HOT (no index entry written).
    rows_inserted: i64,
    rows_updated: i64,
    rows_hot: i64,
}

impl std::ops::Sub for Counters {
    type Output = Counters;
    fn sub(self, b: Counters) -> Counters {
        Counters {
            checkpoints: self.checkpoints - b.checkpoints,
            wal_syncs: self.wal_syncs - b.wal_syncs,
            wal_bytes: self.wal_bytes - b.wal_bytes,
            rows_inserted: self.rows_inserted - b.rows_inserted,
            rows_updated: self.rows_updated - b.rows_updated,
            rows_hot: self.rows_hot - b.rows_hot,
        }
    }
}

/// Reads [`Counters`] once they have settled. PostgreSQL backends publish
/// their statistics when they go idle, but one that published less than a
/// second before, or met a lock, waits ten seconds to publish again: so this
/// reads until two readings 10.5 s apart agree (after a phase nothing else
/// runs), for at most a minute.
async fn counters(db: &Db) -> anyhow::Result<Counters> {
    eprintln!("  reading PostgreSQL's statistics (published up to 10 s late)…");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = read_counters(db).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(10_500)).await;
        let now = read_counters(db).await?;
        if now == last || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// The server's WAL insert position, in bytes.
async fn wal_position(db: &Db) -> anyhow::Result<i64> {
    #[derive(diesel::QueryableByName)]
    struct Lsn {
        #[diesel(sql_type = BigInt)]
        at: i64,
    }
    let mut conn = db.conn().await?;
    let r: Lsn = diesel::sql_query(
        "/* bench */ SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint AS at",
    )
    .get_result(&mut conn)
    .await?;
    Ok(r.at)
}

async fn read_counters(db: &Db) -> anyhow::Result<Counters> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        checkpoints: i64,
        #[diesel(sql_type = BigInt)]
        wal_syncs: i64,
        #[diesel(sql_type = BigInt)]
        ins: i64,
        #[diesel(sql_type = BigInt)]
        upd: i64,
        #[diesel(sql_type = BigInt)]
        hot: i64,
    }
    let mut conn = db.conn().await?;
    let _ = conn.batch_execute("SELECT pg_stat_clear_snapshot()").await;
    let r: Row = diesel::sql_query(
        "/* bench */ SELECT (SELECT count(*) FROM job_history) AS checkpoints, \
         w.wal_sync AS wal_syncs, \
         t.ins::bigint AS ins, t.upd::bigint AS upd, t.hot::bigint AS hot \
         FROM pg_stat_wal w, \
         (SELECT coalesce(sum(n_tup_ins), 0) AS ins, coalesce(sum(n_tup_upd), 0) AS upd, \
                 coalesce(sum(n_tup_hot_upd), 0) AS hot \
          FROM pg_stat_user_tables WHERE relname <> 'bench_commits') t",
    )
    .get_result(&mut conn)
    .await?;
    Ok(Counters {
        checkpoints: r.checkpoints,
        wal_syncs: r.wal_syncs,
        wal_bytes: 0,
        rows_inserted: r.ins,
        rows_updated: r.upd,
        rows_hot: r.hot,
    })
}

/// Durable one-row commits per second from `workers` pooled connections.
async fn commit_rate(db: &Db, workers: usize, duration: Duration) -> anyhow::Result<f64> {
    {
        let mut conn = db.conn().await?;
        conn.batch_execute("CREATE TABLE IF NOT EXISTS bench_commits (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())")
            .await?;
    }
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks = (0..workers).map(|_| {
        let db = db.clone();
        let count = count.clone();
        async move {
            while start.elapsed() < duration {
                let mut conn = db.conn().await?;
                diesel::sql_query("INSERT INTO bench_commits DEFAULT VALUES")
                    .execute(&mut conn)
                    .await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }
    });
    for r in futures_util::future::join_all(tasks).await {
        r?;
    }
    let rate = AtomicU64::load(&count, Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    let mut conn = db.conn().await?;
    conn.batch_execute("DROP TABLE bench_commits").await?;
    Ok(rate)
}

/// Scale mode: every job in flight at once against a slow provider in a child process.
async fn hold(
    args: &BenchArgs,
    db: Db,
    run_id: &str,
    telemetry: &std::sync::Arc<onceflow_observability::Telemetry>,
) -> anyhow::Result<()> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "fake-provider",
            "--latency-ms",
            &args.model_latency_ms.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the fake provider process")?;
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let (mut line, mut hook) = (String::new(), String::new());
    out.read_line(&mut line)?;
    out.read_line(&mut hook)?;
    let provider_url = line.trim().to_owned();
    let hook = hook.trim().to_owned();
    anyhow::ensure!(
        provider_url.starts_with("http") && hook.starts_with("http"),
        "the fake provider and consumer did not start"
    );

    let store = Store::new(db.clone());
    let mut config = EngineConfig {
        max_in_flight: args.max_in_flight.max(args.jobs),
        lease: Duration::from_millis(args.lease_ms),
        poll_interval: Duration::from_millis(500),
        telemetry: telemetry.clone(),
        url_guard: onceflow_engine::UrlGuard::strict().allowing_url(&hook),
        ..EngineConfig::default()
    };
    config.provider.base_url = provider_url;
    config.provider.timeout = Duration::from_millis(args.model_latency_ms + 60_000);
    config.provider.h2c = !args.provider_http1;
    let engine = Engine::start(
        store.clone(),
        onceflow_workflows::registry(),
        Faults::new(),
        config,
    );

    eprintln!(
        "hold: {} jobs, provider latency {} ms, lease {} ms…",
        args.jobs, args.model_latency_ms, args.lease_ms
    );
    let rss_before = peak_rss_mib();
    let prefix = format!("{run_id}-hold");
    let start = Instant::now();
    let submitted = std::cell::Cell::new(None);
    let submitting = async {
        use futures_util::StreamExt;
        let results: Vec<anyhow::Result<()>> = futures_util::stream::iter(0..args.jobs)
            .map(|i| {
                let store = store.clone();
                let job = onceflow_engine::node::intake::NewJob {
                    tags: Default::default(),
                    id: format!("bench-{prefix}-{i}"),
                    workflow: "completion".to_owned(),
                    workflow_version: 1,
                    input: json!({ "model": "bench", "messages": [{ "role": "user", "content": "hi" }] }),
                    webhook_url: hook.clone(),
                    schedule: Default::default(),
                };
                async move {
                    store.jobs().submit(&onceflow_engine::store::Submission::new(&job)).await?;
                    Ok(())
                }
            })
            .buffer_unordered(args.concurrency.max(1))
            .collect()
            .await;
        submitted.set(Some(start.elapsed()));
        results.into_iter().collect::<anyhow::Result<Vec<()>>>()
    };
    let mut max_in_flight = 0;
    let pattern = format!("bench-{prefix}-%");
    let monitoring = async {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let in_flight = engine.in_flight().await;
            max_in_flight = max_in_flight.max(in_flight);
            let done = acked(&db, &pattern).await?;
            eprintln!(
                "  {:.0} s: {in_flight} in flight, {done}/{} acked, peak RSS {:.0} MiB",
                start.elapsed().as_secs_f64(),
                args.jobs,
                peak_rss_mib()
            );
            if done >= args.jobs as i64 {
                return anyhow::Ok(());
            }
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(1800),
                "jobs did not finish within 30 minutes"
            );
        }
    };
    let (sent, watched) = tokio::join!(submitting, monitoring);
    sent?;
    watched?;
    let submitted = submitted.get().unwrap_or_default();
    let elapsed = start.elapsed();
    let counters = engine.counters();
    let renewals = AtomicU64::load(&counters.renewals, Ordering::Relaxed);
    let renewed = AtomicU64::load(&counters.renewed_leases, Ordering::Relaxed);
    engine.shutdown();
    drop(child.stdin.take());
    let _ = child.wait();

    println!();
    println!(
        "onceflow-bench bench --hold: {} jobs, provider latency {} ms",
        args.jobs, args.model_latency_ms
    );
    println!(
        "{:<44} {:>12}",
        "submitted in (s)",
        format!("{:.1}", submitted.as_secs_f64())
    );
    println!(
        "{:<44} {:>12}",
        "all acked after (s)",
        format!("{:.1}", elapsed.as_secs_f64())
    );
    println!(
        "{:<44} {:>12}",
        "most jobs in flight at once", max_in_flight
    );
    println!(
        "{:<44} {:>12}",
        "peak RSS before submitting (MiB)",
        format!("{rss_before:.0}")
    );
    println!(
        "{:<44} {:>12}",
        "peak RSS of the engine process (MiB)",
        format!("{:.0}", peak_rss_mib())
    );
    println!("{:<44} {:>12}", "lease-renewal statements", renewals);
    println!(
        "{:<44} {:>12}",
        "lease-renewal statements/s",
        format!("{:.2}", renewals as f64 / elapsed.as_secs_f64())
    );
    println!(
        "{:<44} {:>12}",
        "leases renewed/s (rows)",
        format!("{:.0}", renewed as f64 / elapsed.as_secs_f64())
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::best_rate;

    #[test]
    fn the_denominator_is_the_best_pgbench_rate() {
        assert_eq!(best_rate(&[(16, 14_112.0), (64, 15_178.0)]), Some(15_178.0));
        assert_eq!(best_rate(&[(16, 17_538.0), (64, 12_273.0)]), Some(17_538.0));
        assert_eq!(best_rate(&[]), None, "no pgbench: the pooled probe instead");
    }
}
