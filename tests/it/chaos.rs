//! A chaos run of the real binary: several hundred jobs against a slow
//! provider, `onceflow serve` SIGKILLed at random moments and restarted, and
//! PostgreSQL itself crashed once mid-run (`-m immediate`, fsync on, so crash
//! recovery replays the WAL). Every job must end acked with its model work
//! done once and its webhook processed once, under one key. The schedule is
//! seeded and the seed printed: `CHAOS_SEED=<seed>` replays it.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use onceflow_engine::db::{self, Db};
use onceflow_engine::pg::{Durability, EmbeddedPg};
use onceflow_engine::testkit::{wait_until, FakeConsumer, FakeProvider};
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::support::{client, get, ServeProcess};

const JOBS: usize = 300;

#[actix_rt::test]
async fn jobs_survive_random_sigkills_and_a_postgres_restart() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("chaos: seed {seed} (CHAOS_SEED={seed} replays this schedule)");
    // A server of its own, durable (fsync on): this test crashes it.
    let pg = EmbeddedPg::throwaway().expect("start PostgreSQL");
    pg.stop().expect("stop the fast test server");
    pg.restart(Durability::Durable)
        .expect("start PostgreSQL with fsync on");
    db::create_database(&pg.url("postgres"), "chaos", None)
        .await
        .unwrap();
    Db::connect(&pg.url("chaos"), 1)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(800));
    let consumer = FakeConsumer::start();
    let env = [
        ("DATABASE_URL", pg.url("chaos")),
        ("OPENAI_BASE_URL", provider.base_url()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
        ("ONCEFLOW_POLL_MS", "100".to_owned()),
        ("ONCEFLOW_RETRY_BASE_MS", "50".to_owned()),
        ("ONCEFLOW_MAX_IN_FLIGHT", "40".to_owned()),
        ("ONCEFLOW_MODEL_TIMEOUT_MS", "3000".to_owned()),
        ("ONCEFLOW_WEBHOOK_TIMEOUT_MS", "3000".to_owned()),
    ];
    let started = Instant::now();
    let mut serve = ServeProcess::start(&env, &log).await;
    let ids: Vec<String> = (0..JOBS).map(|i| format!("chaos-{i:03}")).collect();
    let base = serve.base.clone();

    // Clients keep submitting while the server dies under them: a submission
    // that got no answer is simply sent again (intake is idempotent on the id).
    let submitting = async {
        for id in &ids {
            let body = json!({
                "id": id, "workflow": "completion", "webhook_url": consumer.url(),
                "input": { "model": "m", "messages": [{ "role": "user", "content": id }] },
            });
            loop {
                match client()
                    .post(format!("{base}/v1/jobs"))
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 201 || r.status() == 200 => break,
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
    };
    let chaos = async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for round in 0..4 {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
            eprintln!(
                "chaos: SIGKILL {round} after {:.1} s, {} model calls done",
                started.elapsed().as_secs_f64(),
                provider.total_work()
            );
            serve.sigkill();
            if round == 1 {
                eprintln!(
                    "chaos: crashing PostgreSQL (-m immediate) after {:.1} s",
                    started.elapsed().as_secs_f64()
                );
                pg.crash().expect("crash PostgreSQL");
                tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
                pg.restart(Durability::Durable)
                    .expect("restart PostgreSQL (crash recovery)");
            }
            serve.restart_on_same_port(&env, &log).await;
        }
    };
    tokio::join!(submitting, chaos);

    let done = wait_until(Duration::from_secs(240), || async {
        let mut acked = 0;
        for id in &ids {
            if get(&format!("{base}/v1/jobs/{id}")).await.1["state"] == "acked" {
                acked += 1;
            }
        }
        acked == JOBS
    })
    .await;
    assert!(
        done,
        "not every job was acked; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    for id in &ids {
        let key = format!("job:{id}:completed");
        let keys: HashSet<_> = consumer
            .deliveries_for(id)
            .iter()
            .map(|d| d.webhook_id.clone())
            .collect();
        assert_eq!(
            keys,
            HashSet::from([Some(key)]),
            "{id}: one distinct delivery key"
        );
        assert_eq!(consumer.processed_for(id), 1, "{id}: processed once");
        assert_eq!(
            provider.work_done(&format!("job:{id}:generate")),
            1,
            "{id}: model work once"
        );
        let (_, job) = get(&format!("{base}/v1/jobs/{id}")).await;
        let states: Vec<&str> = job["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["state"].as_str().unwrap())
            .collect();
        assert_eq!(
            states,
            [
                "received",
                "generated",
                "persisted",
                "claimed",
                "delivered",
                "acked"
            ],
            "{id}"
        );
    }
    crate::support::assert_model_work_once_per_job(&provider, &ids);
    let repeats = consumer.deliveries().iter().filter(|d| d.duplicate).count();
    let model_requests = provider.requests().len();
    println!(
        "chaos (seed {seed}): {JOBS} jobs, 4 SIGKILLs, 1 PostgreSQL crash in {:.1} s: {model_requests} model requests for {JOBS} units of work, \
         {repeats} repeated webhook requests (same key, dropped by the consumer)",
        started.elapsed().as_secs_f64()
    );
    serve.sigterm();
}
