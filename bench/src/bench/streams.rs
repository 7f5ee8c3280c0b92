//! `onceflow-bench bench --streams N`: N streamed completions at once, each
//! followed by a watcher on `GET /v1/jobs/{id}/events`, against a loopback
//! provider that streams a chunk every `--stream-interval-ms`. For every
//! chunk it measures the delay from the moment the provider wrote it to the
//! moment a watcher received it — journaled, committed, announced and read
//! back first — and prints the percentiles, for the first chunk (time to
//! first token) and for all of them (inter-token delay).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use onceflow_engine::api::{self, ApiState};
use onceflow_engine::testkit::{FakeConsumer, FakeProvider};
use onceflow_engine::{Db, Engine, EngineConfig, Faults, Store};
use serde_json::{json, Value};

use super::BenchArgs;

/// What one watcher saw: each chunk's offset, when it arrived, and when
/// PostgreSQL inserted it (`at`, wall clock).
type Seen = Vec<(usize, Instant, chrono::DateTime<chrono::Utc>)>;

async fn watch(client: reqwest::Client, url: String) -> anyhow::Result<Seen> {
    let mut response = client.get(&url).send().await?.error_for_status()?;
    let (mut buffer, mut seen) = (String::new(), Vec::new());
    while let Some(chunk) = response.chunk().await? {
        let now = Instant::now();
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            let event: Value = serde_json::from_str(data)?;
            if event["kind"] == "chunk" {
                let at = event["at"]
                    .as_str()
                    .and_then(|a| chrono::DateTime::parse_from_rfc3339(a).ok())
                    .map(|a| a.with_timezone(&chrono::Utc))
                    .unwrap_or_default();
                seen.push((
                    event["offset"].as_u64().unwrap_or_default() as usize,
                    now,
                    at,
                ));
            }
        }
    }
    Ok(seen)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Runs the streaming benchmark with `streams` jobs at once.
pub(super) async fn run(
    args: &BenchArgs,
    db: Db,
    run_id: &str,
    streams: usize,
) -> anyhow::Result<()> {
    let provider = FakeProvider::start();
    let interval = Duration::from_millis(args.stream_interval_ms);
    provider.set_stream_shape(args.stream_chunks, interval);
    provider.set_stream_jitter(!args.stream_aligned);
    let consumer = FakeConsumer::start();
    let store = Store::new(db.clone());
    let registry = onceflow_workflows::registry();
    let guard = onceflow_engine::UrlGuard::strict().allowing_url(&consumer.url());
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let base = format!("http://{}", listener.local_addr()?);
    let hub = std::sync::Arc::new(onceflow_engine::hub::Hub::default());
    let state = ApiState {
        store: store.clone(),
        registry: registry.clone(),
        body_limit: api::DEFAULT_BODY_LIMIT,
        telemetry: std::sync::Arc::new(onceflow_observability::Telemetry::disabled()),
        url_guard: guard.clone(),
        hosts: api::Hosts::Any,
        auth: api::Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        // The engine started below shares it: its streams' chunks reach
        // these watchers.
        hub: hub.clone(),
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

    eprintln!(
        "streams: {streams} streamed completions at once, {} chunks each, one every {} ms{}, each watched…",
        args.stream_chunks,
        args.stream_interval_ms,
        if args.stream_aligned {
            " (in lockstep)"
        } else {
            " on average (each gap 0.5–1.5×)"
        }
    );
    let ids: Vec<String> = (0..streams)
        .map(|i| format!("bench-{run_id}-stream-{i}"))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(
                &onceflow_engine::node::intake::NewJob {
                    tags: Default::default(),
                    id: id.clone(),
                    workflow: "completion".to_owned(),
                    workflow_version: 1,
                    input: json!({
                        "model": "bench",
                        "stream": true,
                        "messages": [{ "role": "user", "content": "hi" }]
                    }),
                    webhook_url: consumer.url(),
                    // Started over the ramp, as streams arrive in a service, so
                    // that all of them run at once from its end on.
                    schedule: onceflow_engine::node::intake::Schedule {
                        delay_ms: Some(1000 + (i as u64 * args.stream_ramp_ms) / streams as u64),
                        ..Default::default()
                    },
                },
            ))
            .await?;
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(streams)
        .build()?;
    // The watchers are clients: a thread of their own, not the engine's.
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let watchers: Vec<_> = ids
        .iter()
        .map(|id| {
            let url = format!("{base}/v1/jobs/{id}/events");
            clients.spawn(watch(client.clone(), url))
        })
        .collect();
    // The watchers connect before any job starts (the first one second later).
    let mut config = EngineConfig {
        max_in_flight: args.max_in_flight.max(streams),
        poll_interval: Duration::from_millis(20),
        url_guard: guard,
        hub,
        ..EngineConfig::default()
    };
    config.provider.base_url = provider.base_url();
    let engine = Engine::start(store.clone(), registry, Faults::new(), config);
    let started = Instant::now();
    let mut seen: HashMap<String, Seen> = HashMap::new();
    for (id, w) in ids.iter().zip(watchers) {
        seen.insert(id.clone(), w.await??);
    }
    let elapsed = started.elapsed();
    clients.shutdown_background();
    engine.shutdown();
    server_handle.stop(true).await;

    let sent: HashMap<(String, usize), Instant> = provider
        .chunks_sent_at()
        .into_iter()
        .map(|(key, i, at)| ((key, i), at))
        .collect();
    // Instants to wall-clock time, to compare with PostgreSQL's `at`.
    let (ref_instant, ref_wall) = (Instant::now(), chrono::Utc::now());
    let wall = |i: Instant| ref_wall - (ref_instant - i);
    let (mut first, mut all, mut to_insert, mut to_watcher) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut missing = 0usize;
    for id in &ids {
        let key = format!("job:{id}:generate");
        for &(offset, got, inserted) in &seen[id] {
            match sent.get(&(key.clone(), offset)) {
                Some(s) => {
                    let ms = got.saturating_duration_since(*s).as_secs_f64() * 1e3;
                    all.push(ms);
                    if offset == 0 {
                        first.push(ms);
                    }
                    let ms = |d: chrono::TimeDelta| d.num_microseconds().unwrap_or(0) as f64 / 1e3;
                    to_insert.push(ms(inserted - wall(*s)));
                    to_watcher.push(ms(wall(got) - inserted));
                }
                None => missing += 1,
            }
        }
    }
    for v in [&mut first, &mut all, &mut to_insert, &mut to_watcher] {
        v.sort_by(f64::total_cmp);
    }
    let chunks = all.len();
    println!();
    println!(
        "onceflow-bench bench --streams {streams}: {chunks} chunks watched in {:.1} s ({:.0} chunks/s through the journal){}",
        elapsed.as_secs_f64(),
        chunks as f64 / elapsed.as_secs_f64(),
        if missing > 0 { format!(", {missing} unmatched") } else { String::new() }
    );
    println!("delay from the provider writing a chunk to a watcher receiving it (ms):");
    println!(
        "{:<24} {:>8} {:>8} {:>8} {:>8}",
        "", "p50", "p90", "p99", "max"
    );
    for (name, v) in [
        ("first chunk (TTFT)", &first),
        ("every chunk", &all),
        ("  provider → inserted", &to_insert),
        ("  inserted → watcher", &to_watcher),
    ] {
        println!(
            "{name:<24} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            percentile(v, 0.5),
            percentile(v, 0.9),
            percentile(v, 0.99),
            v.last().copied().unwrap_or(f64::NAN)
        );
    }
    let expected = streams * args.stream_chunks;
    anyhow::ensure!(
        chunks == expected,
        "watchers saw {chunks} chunks, expected {expected}"
    );
    Ok(())
}
