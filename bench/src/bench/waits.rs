//! `onceflow-bench bench --waiting N`: what waiting costs. N jobs of a
//! workflow that sleeps an hour are submitted and run to their wait; then
//! it prints the engine process's resident memory before and with them
//! waiting, the statements the node issues in 65 idle seconds
//! (`pg_stat_statements`), and how fast `--timers` jobs whose timers fall
//! due in the same second resume (from the due time to the last wait's
//! recorded outcome, by the database's clock).

use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Double};
use diesel_async::RunQueryDsl;
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::FakeConsumer;
use onceflow_engine::{
    Context, Db, Engine, EngineConfig, Faults, Registry, StepError, Store, Workflow,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::BenchArgs;

#[derive(Deserialize)]
struct SleepInput {
    /// Sleep this long …
    #[serde(default)]
    sleep_s: Option<u64>,
    /// … or until then.
    #[serde(default)]
    until: Option<chrono::DateTime<chrono::Utc>>,
}

/// Sleeps, then ends: the cheapest job that waits.
struct Sleeper;

impl Workflow for Sleeper {
    const NAME: &'static str = "bench.sleeper";
    type Input = SleepInput;
    type Output = Value;

    async fn run(&self, ctx: &mut Context, input: SleepInput) -> Result<Value, StepError> {
        match input.until {
            Some(at) => ctx.sleep_until("nap", at).await?,
            None => {
                ctx.sleep("nap", Duration::from_secs(input.sleep_s.unwrap_or(3600)))
                    .await?
            }
        }
        Ok(json!({ "woke": true }))
    }
}

/// When the `timers` jobs matching `pattern` were finished, after `due`:
/// p50 and last, in seconds (waits until all are).
async fn finished(
    db: &Db,
    pattern: &str,
    due: chrono::DateTime<chrono::Utc>,
    timers: usize,
) -> anyhow::Result<(f64, f64)> {
    #[derive(diesel::QueryableByName)]
    struct Done {
        #[diesel(sql_type = BigInt)]
        n: i64,
        #[diesel(sql_type = Double)]
        p50_s: f64,
        #[diesel(sql_type = Double)]
        last_s: f64,
    }
    loop {
        let mut conn = db.conn().await?;
        let d: Done = diesel::sql_query(
            "/* bench */ SELECT count(*) AS n, \
                 coalesce(percentile_cont(0.5) WITHIN GROUP \
                     (ORDER BY extract(epoch FROM finished_at - $2::timestamptz)), 0)::float8 AS p50_s, \
                 coalesce(extract(epoch FROM max(finished_at) - $2::timestamptz), 0)::float8 AS last_s \
             FROM jobs WHERE id LIKE $1 AND state = 'acked'",
        )
        .bind::<diesel::sql_types::Text, _>(pattern)
        .bind::<diesel::sql_types::Timestamptz, _>(due)
        .get_result(&mut conn)
        .await?;
        if d.n as usize >= timers {
            return Ok((d.p50_s, d.last_s));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// This process's resident memory now (VmRSS), in MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn count(db: &Db, query: &'static str) -> anyhow::Result<i64> {
    let mut conn = db.conn().await?;
    let c: Count = diesel::sql_query(query).get_result(&mut conn).await?;
    Ok(c.n)
}

/// Statements this database's sessions ran, the bench's own excluded.
async fn statements(db: &Db) -> anyhow::Result<i64> {
    count(
        db,
        "/* bench */ SELECT coalesce(sum(s.calls), 0)::bigint AS n FROM pg_stat_statements s \
         JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = current_database() AND s.query NOT LIKE '%/* bench */%' \
           AND s.query NOT LIKE '%pg_stat_statements%'",
    )
    .await
}

/// This database's statements since the last reset, most called first:
/// calls, mean execution time (ms) and the statement.
async fn idle_statements(db: &Db) -> anyhow::Result<Vec<(i64, f64, String)>> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        calls: i64,
        #[diesel(sql_type = Double)]
        mean_ms: f64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        query: String,
    }
    let mut conn = db.conn().await?;
    let rows: Vec<Row> = diesel::sql_query(
        "/* bench */ SELECT s.calls, s.mean_exec_time AS mean_ms, s.query FROM pg_stat_statements s \
         JOIN pg_database d ON d.oid = s.dbid \
         WHERE d.datname = current_database() AND s.query NOT LIKE '%/* bench */%' \
           AND s.query NOT LIKE '%pg_stat_statements%' \
         ORDER BY s.calls DESC LIMIT 8",
    )
    .load(&mut conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.calls, r.mean_ms, r.query))
        .collect())
}

async fn submit(
    store: &Store,
    prefix: &str,
    n: usize,
    input: Value,
    url: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut next = 0;
    while next < n {
        let batch: Vec<_> = (next..(next + 500).min(n))
            .map(|i| {
                let store = store.clone();
                let job = NewJob {
                    tags: Default::default(),
                    id: format!("{prefix}-{i}"),
                    workflow: Sleeper::NAME.to_owned(),
                    workflow_version: 1,
                    input: input.clone(),
                    webhook_url: url.to_owned(),
                    schedule: Default::default(),
                };
                async move {
                    store
                        .jobs()
                        .submit(&onceflow_engine::store::Submission::new(&job))
                        .await
                }
            })
            .collect();
        for r in futures_util::future::join_all(batch).await {
            r?;
        }
        next = (next + 500).min(n);
        if next % 10_000 == 0 || next == n {
            eprintln!(
                "  {next}/{n} submitted ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

async fn until_waiting(db: &Db, n: i64, what: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let waiting = count(
            db,
            "/* bench */ SELECT count(*) AS n FROM jobs WHERE waiting IS NOT NULL AND finished_at IS NULL",
        )
        .await?;
        if waiting >= n {
            return Ok(started.elapsed());
        }
        if started.elapsed() > Duration::from_secs(1800) {
            anyhow::bail!("only {waiting} of {n} {what} jobs reached their wait in 30 min");
        }
        eprintln!(
            "  {waiting}/{n} waiting ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// How long the idle statements are counted: over a minute, longer than
/// any housekeeping cadence a node ever kept, so a timer of its own shows.
const IDLE_WINDOW: Duration = Duration::from_secs(65);

/// Runs the waiting benchmark with `n` sleeping jobs and `timers` timers
/// due in the same second.
pub(super) async fn run(
    args: &BenchArgs,
    db: Db,
    run_id: &str,
    n: usize,
    timers: usize,
) -> anyhow::Result<()> {
    if !super::costs::reset_statements(&db).await {
        eprintln!("pg_stat_statements is not loaded: no statement counts");
    }
    let consumer = FakeConsumer::start();
    let store = Store::new(db.clone());
    let mut registry = Registry::new();
    registry.register(Sleeper);
    let config = EngineConfig {
        node_id: "bench-waits".to_owned(),
        max_in_flight: args.max_in_flight,
        url_guard: onceflow_engine::UrlGuard::strict().allowing_url(&consumer.url()),
        ..EngineConfig::default()
    };
    let engine = Engine::start(store.clone(), registry, Faults::new(), config);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rss = rss_mib();
    println!("onceflow-bench bench --waiting {n} --timers {timers} (durable PostgreSQL, one node)");
    println!("engine process RSS, idle: {idle_rss:.1} MiB");

    eprintln!("submitting {n} jobs that sleep an hour…");
    submit(
        &store,
        &format!("w{run_id}"),
        n,
        json!({ "sleep_s": 3600 }),
        &consumer.url(),
    )
    .await?;
    let took = until_waiting(&db, n as i64, "sleeping").await?;
    println!(
        "{n} jobs waiting, {:.0} s after the last submission",
        took.as_secs_f64()
    );
    println!("actors in flight: {}", engine.in_flight().await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let waiting_rss = rss_mib();
    println!(
        "engine process RSS with {n} waiting: {waiting_rss:.1} MiB ({:+.1} MiB over idle)",
        waiting_rss - idle_rss
    );

    super::costs::reset_statements(&db).await;
    let before = statements(&db).await;
    let idle = IDLE_WINDOW.as_secs();
    eprintln!("counting the statements of {idle} idle seconds…");
    tokio::time::sleep(IDLE_WINDOW).await;
    match (before, statements(&db).await) {
        (Ok(a), Ok(b)) => {
            println!(
                "statements in {idle} idle seconds (nothing due): {} ({:.2}/s), by statement:",
                b - a,
                (b - a) as f64 / idle as f64
            );
            for (calls, mean_ms, query) in idle_statements(&db).await.unwrap_or_default() {
                let query: String = query.split_whitespace().collect::<Vec<_>>().join(" ");
                println!(
                    "  {calls:>4} × {mean_ms:>7.3} ms  {}",
                    query.chars().take(100).collect::<String>()
                );
            }
        }
        _ => println!("statements: pg_stat_statements is not loaded"),
    }

    // What listing costs with them waiting: the console's "waiting for
    // approval" (none here) and "waiting" pages, 20 reads each.
    for (what, kind) in [
        ("?waiting=approval", Some("approval")),
        ("?waiting=true", None),
    ] {
        let filter = onceflow_engine::store::ListFilter {
            waiting: Some(true),
            waiting_kind: kind.map(str::to_owned),
            limit: 50,
            ..Default::default()
        };
        let started = Instant::now();
        for _ in 0..20 {
            store.jobs().list(&filter).await?;
        }
        println!(
            "GET /v1/jobs{what} (a page of 50) with {n} waiting: {:.2} ms a read",
            started.elapsed().as_secs_f64() * 1000.0 / 20.0
        );
    }

    if timers > 0 {
        // Due together, far enough ahead that every job reaches its wait first.
        let lead = Duration::from_secs(30 + (timers / 500) as u64);
        let due = chrono::Utc::now() + chrono::Duration::from_std(lead)?;
        eprintln!("submitting {timers} jobs whose timers fall due at {due}…");
        submit(
            &store,
            &format!("t{run_id}"),
            timers,
            json!({ "until": due }),
            &consumer.url(),
        )
        .await?;
        until_waiting(&db, (n + timers) as i64, "timer").await?;
        let pattern = format!("t{run_id}-%");
        let woke = loop {
            let mut conn = db.conn().await?;
            #[derive(diesel::QueryableByName)]
            struct Woke {
                #[diesel(sql_type = BigInt)]
                n: i64,
                #[diesel(sql_type = Double)]
                first_s: f64,
                #[diesel(sql_type = Double)]
                p50_s: f64,
                #[diesel(sql_type = Double)]
                last_s: f64,
            }
            let w: Woke = diesel::sql_query(
                "/* bench */ SELECT count(*) AS n, \
                     coalesce(extract(epoch FROM min(done_at) - $2::timestamptz), 0)::float8 AS first_s, \
                     coalesce(percentile_cont(0.5) WITHIN GROUP \
                         (ORDER BY extract(epoch FROM done_at - $2::timestamptz)), 0)::float8 AS p50_s, \
                     coalesce(extract(epoch FROM max(done_at) - $2::timestamptz), 0)::float8 AS last_s \
                 FROM waits WHERE job_id LIKE $1 AND done_at IS NOT NULL",
            )
            .bind::<diesel::sql_types::Text, _>(&pattern)
            .bind::<diesel::sql_types::Timestamptz, _>(due)
            .get_result(&mut conn)
            .await?;
            if w.n as usize >= timers {
                break (w, finished(&db, &pattern, due, timers).await?);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let (woke, done) = woke;
        println!(
            "{timers} timers due in the same second: fired (job leased, wait's outcome recorded) after the due time: first {:.2} s, p50 {:.2} s, last {:.2} s ({:.0} jobs/s)",
            woke.first_s,
            woke.p50_s,
            woke.last_s,
            timers as f64 / woke.last_s.max(0.001)
        );
        println!(
            "  the same jobs acked (the body's rest run, result committed, webhook delivered): p50 {:.2} s, last {:.2} s ({:.0} jobs/s)",
            done.0,
            done.1,
            timers as f64 / done.1.max(0.001)
        );
    }
    engine.shutdown_gracefully().await?;
    Ok(())
}
