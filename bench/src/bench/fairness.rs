//! `onceflow-bench bench --fairness`: what fairness between tenants costs,
//! and what it buys.
//!
//! 1. The acquire statement's time (16 jobs a call, 200 calls, each
//!    released again untimed) with 100,000 queued jobs spread over 1, 100
//!    and 1,000 tokens, and over 100 tokens with 100,000 distinct
//!    concurrency keys (then with each key throttled to one start a
//!    minute, so every job taken needs a start slot); beside it, at one
//!    token, the statement before fairness (ordered by priority and due
//!    time alone, no keys) on the same rows: the cost of fairness in the
//!    statement every job passes.
//! 2. Time to another tenant's first start: one node (16 in flight, model
//!    calls of 100 ms) busy with tenant A's backlog of 10,000 jobs; tenant B
//!    submits one job at a time, 30 in all; from each submit's return to
//!    its model request at the provider, p50 and p99.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::testkit::FakeProvider;
use onceflow_engine::{Db, Engine, EngineConfig, Faults, Registry, Store};
use serde_json::json;

use super::BenchArgs;

/// The acquire as it was before fairness (afce946's `Leases::acquire`, its
/// lease update kept and its timer and filters dropped), kept here only to measure against.
const ACQUIRE_BEFORE: &str = "WITH picked AS ( \
         SELECT id FROM jobs \
         WHERE finished_at IS NULL AND run_at <= now() \
           AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp()) \
         ORDER BY priority DESC, run_at LIMIT 16 \
         FOR UPDATE SKIP LOCKED) \
     UPDATE jobs j SET lease_owner = 'bench-node', lease_epoch = j.lease_epoch + 1, \
         lease_expires_at = clock_timestamp() + interval '60 seconds', attempts = j.attempts + 1 \
     FROM picked WHERE j.id = picked.id RETURNING j.id";

const QUEUED: i64 = 100_000;
const CALLS: usize = 200;

async fn exec(db: &Db, query: &str) -> anyhow::Result<usize> {
    let mut conn = db.conn().await?;
    Ok(diesel::sql_query(query).execute(&mut conn).await?)
}

/// What the queued jobs carry besides their tenant.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// No concurrency key.
    None,
    /// A key each (limit 1).
    Each,
    /// A key each (limit 1), throttled to 1 start a minute: every job the
    /// acquire takes needs a start slot.
    Throttled,
}

/// Empties the tables and queues `QUEUED` jobs over `tokens` tenants
/// (round robin), each with its own concurrency key (and throttle) as
/// `keys` says.
async fn queue(db: &Db, tokens: i64, keys: Keys) -> anyhow::Result<()> {
    exec(
        db,
        "/* bench */ TRUNCATE jobs, job_history, api_tokens CASCADE",
    )
    .await?;
    let mut conn = db.conn().await?;
    diesel::sql_query(
        "/* bench */ INSERT INTO api_tokens (id, name, token_hash) \
         SELECT t, 'tenant-' || t, encode(sha256(t::text::bytea), 'hex') FROM generate_series(1, $1) t",
    )
    .bind::<BigInt, _>(tokens)
    .execute(&mut conn)
    .await?;
    diesel::sql_query(
        "/* bench */ INSERT INTO jobs (id, workflow, workflow_version, request, request_hash, \
             owner_token, tenant, concurrency_key, concurrency_limit, throttle_limit, \
             throttle_period_s, run_at) \
         SELECT 'q-' || i, 'completion', 1, '{}'::jsonb, encode(sha256(i::text::bytea), 'hex'), 1 + i % $1, 1 + i % $1, \
             CASE WHEN $2 <> '' THEN 'key-' || i END, CASE WHEN $2 <> '' THEN 1 END, \
             CASE WHEN $2 = 'throttled' THEN 1 END, CASE WHEN $2 = 'throttled' THEN 60 END, \
             now() - interval '1 hour' + i * interval '1 millisecond' \
         FROM generate_series(1, $3) i",
    )
    .bind::<BigInt, _>(tokens)
    .bind::<Text, _>(match keys {
        Keys::None => "",
        Keys::Each => "keys",
        Keys::Throttled => "throttled",
    })
    .bind::<BigInt, _>(QUEUED)
    .execute(&mut conn)
    .await?;
    drop(conn);
    exec(db, "/* bench */ ANALYZE jobs").await?;
    Ok(())
}

/// `CALLS` runs of `acquire` (each releasing what it took, untimed): p50
/// and p99 in milliseconds.
async fn time_calls<F, Fut>(db: &Db, mut acquire: F) -> anyhow::Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<usize>>,
{
    let mut times = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let started = Instant::now();
        let took = acquire().await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(took == 16, "an acquire took {took} jobs, not 16");
        exec(
            db,
            "/* bench */ UPDATE jobs SET lease_owner = NULL, lease_expires_at = NULL, key_slot = NULL, \
                 throttle_slot = NULL, throttle_gen = NULL, throttle_at = NULL \
             WHERE lease_owner = 'bench-node'",
        )
        .await?;
    }
    times.sort_by(f64::total_cmp);
    Ok((times[CALLS / 2], times[CALLS * 99 / 100]))
}

pub async fn run(args: &BenchArgs, db: Db) -> anyhow::Result<()> {
    let store = Store::new(db.clone());
    println!("onceflow-bench bench --fairness (durable PostgreSQL)");
    println!(
        "1. the acquire statement, 16 jobs a call, {CALLS} calls, {QUEUED} jobs queued: p50 / p99 ms"
    );
    for (tokens, keys) in [
        (1, Keys::None),
        (100, Keys::None),
        (1000, Keys::None),
        (100, Keys::Each),
        (100, Keys::Throttled),
    ] {
        let label = match keys {
            Keys::None => "",
            Keys::Each => ", 100,000 concurrency keys",
            Keys::Throttled => ", 100,000 keys throttled 1/min",
        };
        eprintln!("queueing {QUEUED} jobs over {tokens} token(s){label}…");
        queue(&db, tokens, keys).await?;
        let store = store.clone();
        let (p50, p99) = time_calls(&db, || {
            let store = store.clone();
            async move {
                Ok(store
                    .leases()
                    .acquire("bench-node", 16, 60_000, false, None, &[])
                    .await?
                    .len())
            }
        })
        .await?;
        println!("   fair, {tokens:>5} token(s){label:<32} {p50:>7.2} / {p99:>7.2}");
        if tokens == 1 && keys == Keys::None {
            // Its own index then (jobs_runnable), for as long as it runs.
            exec(
                &db,
                "/* bench */ CREATE INDEX bench_runnable ON jobs (priority DESC, run_at) \
                 WHERE finished_at IS NULL",
            )
            .await?;
            let (p50, p99) = time_calls(&db, || exec(&db, ACQUIRE_BEFORE)).await?;
            exec(&db, "/* bench */ DROP INDEX bench_runnable").await?;
            println!("   before fairness, one token                  {p50:>7.2} / {p99:>7.2}");
        }
    }
    exec(
        &db,
        "/* bench */ TRUNCATE jobs, job_history, api_tokens CASCADE",
    )
    .await?;

    println!("2. tenant B's first start behind tenant A's 10,000 queued jobs (16 in flight, 100 ms calls)");
    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(100));
    let a = store.tokens().create("tenant-a", false).await?;
    let a = store
        .tokens()
        .authenticate(&a)
        .await?
        .context("tenant a")?
        .token;
    let b = store.tokens().create("tenant-b", false).await?;
    let b = store
        .tokens()
        .authenticate(&b)
        .await?
        .context("tenant b")?
        .token;
    let job = |id: String| NewJob {
        tags: Default::default(),
        id: id.clone(),
        workflow: "completion".to_owned(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": id }] }),
        webhook_url: String::new(),
        schedule: Default::default(),
    };
    eprintln!("submitting tenant A's 10,000 jobs…");
    for chunk in (0..10_000).collect::<Vec<_>>().chunks(500) {
        let batch = chunk.iter().map(|i| {
            let store = store.clone();
            let job = job(format!("a-{i}"));
            async move {
                store
                    .jobs()
                    .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(a), false))
                    .await
            }
        });
        for r in futures_util::future::join_all(batch).await {
            r?;
        }
    }
    let mut registry = Registry::new();
    registry.register(onceflow_workflows::Completion::default());
    let mut config = EngineConfig {
        node_id: "bench-fair".to_owned(),
        max_in_flight: 16,
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        ..EngineConfig::default()
    };
    config.provider.base_url = provider.base_url();
    let _ = args;
    let engine = Engine::start(store.clone(), registry, Faults::new(), config);
    while provider.requests().len() < 16 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut waits = Vec::new();
    for i in 0..30 {
        let id = format!("b-{i}");
        store
            .jobs()
            .submit(
                &onceflow_engine::store::Submission::new(&job(id.clone())).owned(Some(b), false),
            )
            .await?;
        let submitted = Instant::now();
        let key = format!("job:{id}:");
        loop {
            let seen = provider.requests().iter().any(|r| {
                r.idempotency_key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(&key))
            });
            if seen {
                break;
            }
            anyhow::ensure!(
                submitted.elapsed() < Duration::from_secs(120),
                "tenant B's job {id} did not start within 120 s"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        waits.push(submitted.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let a_left = {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let mut conn = db.conn().await?;
        diesel::sql_query(
            "/* bench */ SELECT count(*) AS n FROM jobs WHERE id LIKE 'a-%' AND finished_at IS NULL",
        )
        .get_result::<N>(&mut conn)
        .await?
        .n
    };
    engine.shutdown();
    waits.sort_by(f64::total_cmp);
    println!(
        "   submit to model request: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} of B's jobs; A still had {a_left} queued at the end)",
        waits[waits.len() / 2],
        waits[waits.len() * 99 / 100],
        waits[waits.len() - 1],
        waits.len()
    );
    Ok(())
}
