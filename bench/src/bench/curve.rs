//! `onceflow-bench bench --limit-curve N`: the learned window against a provider
//! that refuses a call arriving while `N` are in flight, with no limit
//! configured, on two engine nodes sharing the database. It prints, every
//! quarter second, the shared window ([`onceflow_engine::rules::quota`]), the
//! slots held, the requests and the 429s of the interval, then the share of
//! requests refused after the first two seconds (the slow start).

use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Double, Nullable};
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use onceflow_engine::testkit::{FakeConsumer, FakeProvider};
use onceflow_engine::{Db, Engine, EngineConfig, Faults, Store};
use serde_json::json;

use super::BenchArgs;

#[derive(QueryableByName)]
struct Sample {
    #[diesel(sql_type = Nullable<Double>)]
    window: Option<f64>,
    #[diesel(sql_type = BigInt)]
    slots: i64,
    #[diesel(sql_type = BigInt)]
    acked: i64,
}

/// Runs the curve; `limit` is the provider's concurrency.
pub(super) async fn run(
    args: &BenchArgs,
    db: Db,
    run_id: &str,
    limit: usize,
) -> anyhow::Result<()> {
    let provider = FakeProvider::start();
    let latency = args.model_latency_ms.max(50);
    provider.set_latency(Duration::from_millis(latency));
    provider.set_max_concurrent(limit);
    let consumer = FakeConsumer::start();
    let store = Store::new(db.clone());
    let node = |name: &str| {
        let mut config = EngineConfig {
            node_id: name.to_owned(),
            max_in_flight: args.max_in_flight,
            poll_interval: Duration::from_millis(200),
            url_guard: onceflow_engine::UrlGuard::strict().allowing_url(&consumer.url()),
            ..EngineConfig::default()
        };
        config.provider.base_url = provider.base_url();
        Engine::start(
            store.clone(),
            onceflow_workflows::registry(),
            Faults::new(),
            config,
        )
    };
    let nodes = [node("curve-a"), node("curve-b")];
    let model = format!("curve-{run_id}");
    eprintln!(
        "limit curve: {} jobs on 2 nodes, provider accepts {limit} calls at once ({latency} ms each), no limit configured…",
        args.jobs
    );
    let start = Instant::now();
    {
        use futures_util::StreamExt;
        let submitted: Vec<anyhow::Result<()>> = futures_util::stream::iter(0..args.jobs)
            .map(|i| {
                let store = store.clone();
                let job = onceflow_engine::node::intake::NewJob {
                    tags: Default::default(),
                    id: format!("bench-{run_id}-curve-{i}"),
                    workflow: "completion".to_owned(),
                    workflow_version: 1,
                    input: json!({ "model": model, "messages": [{ "role": "user", "content": "hi" }] }),
                    webhook_url: consumer.url(),
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
        submitted.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    }
    eprintln!("  submitted in {:.1} s", start.elapsed().as_secs_f64());
    println!();
    println!(
        "{:>7} {:>8} {:>7} {:>10} {:>6} {:>7}",
        "t (s)", "window", "slots", "requests", "429s", "acked"
    );
    let key = format!("openai/{model}");
    let pattern = format!("bench-{run_id}-curve-%");
    let (mut seen, mut seen_throttled) = (0usize, 0usize);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut conn = db.conn().await?;
        let s: Sample = diesel::sql_query(
            "SELECT (SELECT \"window\" FROM provider_limits WHERE limit_key = $1) AS \"window\", \
                 (SELECT count(*) FROM provider_slots WHERE limit_key = $1) AS slots, \
                 (SELECT count(*) FROM jobs WHERE id LIKE $2 AND state = 'acked') AS acked",
        )
        .bind::<diesel::sql_types::Text, _>(&key)
        .bind::<diesel::sql_types::Text, _>(&pattern)
        .get_result(&mut conn)
        .await?;
        drop(conn);
        let requests = provider.requests();
        let throttled = requests.iter().filter(|r| r.throttled).count();
        println!(
            "{:>7.2} {:>8} {:>7} {:>10} {:>6} {:>7}",
            start.elapsed().as_secs_f64(),
            s.window.map_or("-".to_owned(), |w| format!("{w:.2}")),
            s.slots,
            requests.len() - seen,
            throttled - seen_throttled,
            s.acked
        );
        (seen, seen_throttled) = (requests.len(), throttled);
        if s.acked as usize >= args.jobs {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "the curve's jobs did not finish in 10 minutes"
        );
    }
    for n in nodes {
        n.shutdown();
    }
    let requests = provider.requests();
    let late: Vec<_> = requests
        .iter()
        .filter(|r| r.received_at >= start + Duration::from_secs(2))
        .collect();
    let late_throttled = late.iter().filter(|r| r.throttled).count();
    println!();
    println!(
        "{} jobs in {:.1} s: {} requests, {} answered 429; after the first 2 s {late_throttled} of {} ({:.1} %); peak concurrency {} (the provider's limit {limit})",
        args.jobs,
        start.elapsed().as_secs_f64(),
        requests.len(),
        requests.iter().filter(|r| r.throttled).count(),
        late.len(),
        100.0 * late_throttled as f64 / late.len().max(1) as f64,
        provider.peak_concurrency(),
    );
    Ok(())
}
