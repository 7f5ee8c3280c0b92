//! `onceflow-bench demo`: see the guarantee hold, on the embedded PostgreSQL, with a
//! loopback model provider and webhook consumer started in-process.
//!
//! It submits a batch of completion jobs in groups, each with one kind of
//! fault injected, runs them through the real engine, and prints per group
//! what the provider and the consumer saw: the model's work is done once per
//! job and each job is processed once by the consumer, however many requests
//! the faults caused. It stops everything it started.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::node::intake::NewJob;
use onceflow_engine::rules::retry::RetryPolicy;
use onceflow_engine::testkit::{Behaviour, FakeConsumer, FakeProvider};
use onceflow_engine::{db, Db, Engine, EngineConfig, Faults, JobState, Store};
use serde_json::json;

use onceflow::config::DbArgs;

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Jobs per fault group.
    #[arg(long, default_value_t = 20)]
    pub jobs: usize,
}

/// A group of jobs and the fault each of them gets.
struct Group {
    name: &'static str,
    prefix: &'static str,
    inject: fn(&Faults, &FakeConsumer, &str),
}

const GROUPS: &[Group] = &[
    Group {
        name: "no fault",
        prefix: "clean",
        inject: |_, _, _| {},
    },
    Group {
        name: "provider response lost",
        prefix: "lost",
        // The provider did the work; its answer never arrives.
        inject: |f, _, id| f.arm_once(id, FailPoint::ModelAfterSend, Action::Fail),
    },
    Group {
        name: "webhook answers 503, then 429",
        prefix: "hook",
        inject: |_, c, id| {
            c.push_for(id, Behaviour::Status(503, None));
            c.push_for(id, Behaviour::Status(429, Some(1)));
        },
    },
    Group {
        name: "crash mid-webhook, resumed",
        prefix: "crash",
        // The consumer got the request; the worker died before reading the answer.
        inject: |f, _, id| f.arm_once(id, FailPoint::WebhookAfterSend, Action::Crash),
    },
    Group {
        name: "ack fails after delivery",
        prefix: "ack",
        inject: |f, _, id| f.arm_once(id, FailPoint::Ack, Action::Fail),
    },
];

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let database = args.db.resolve()?;
    let result = actix_web::rt::System::new().block_on(demo(&args, &database));
    if let Some(pg) = database.embedded.as_ref().filter(|pg| pg.started_here()) {
        let _ = pg.stop();
    }
    result
}

async fn demo(args: &DemoArgs, database: &onceflow::config::Database) -> anyhow::Result<()> {
    let run_id = format!("{:x}", chrono::Utc::now().timestamp_millis() % 0xfffff);
    let (url, admin) = match &database.embedded {
        Some(pg) => {
            let name = format!("demo_{run_id}");
            db::create_database(&pg.url("postgres"), &name, None).await?;
            (pg.url(&name), Some((pg.url("postgres"), name)))
        }
        None => (database.url.clone(), None),
    };
    let db = Db::connect(&url, 8).await.context("connecting")?;
    db.migrate().await?;
    let store = Store::new(db);

    let provider = FakeProvider::start();
    provider.set_latency(Duration::from_millis(20));
    let consumer = FakeConsumer::start();
    let faults = Faults::new();
    let fast = RetryPolicy {
        base: Duration::from_millis(50),
        max: Duration::from_millis(500),
        retry_after_cap: Duration::from_secs(2),
        budget: 8,
    };
    let mut config = EngineConfig {
        lease: Duration::from_secs(2),
        poll_interval: Duration::from_millis(100),
        webhook_timeout: Duration::from_secs(2),
        model_retry: fast,
        webhook_retry: fast,
        // The loopback consumer is the only private address it may reach.
        url_guard: onceflow_engine::UrlGuard::strict().allowing_url(&consumer.url()),
        ..EngineConfig::default()
    };
    config.provider.base_url = provider.base_url();
    config.provider.timeout = Duration::from_secs(2);
    let engine = Engine::start(
        store.clone(),
        onceflow_workflows::registry(),
        faults.clone(),
        config,
    );

    let total = GROUPS.len() * args.jobs;
    println!(
        "onceflow-bench demo: {total} completion jobs in {} groups, one fault per group",
        GROUPS.len()
    );
    let mut ids = Vec::new();
    for group in GROUPS {
        for i in 0..args.jobs {
            let id = format!("demo-{run_id}-{}-{i:02}", group.prefix);
            (group.inject)(&faults, &consumer, &id);
            store
                .jobs().submit(&onceflow_engine::store::Submission::new(&NewJob {
                    tags: Default::default(),
                    id: id.clone(),
                    workflow: "completion".to_owned(),
                    workflow_version: 1,
                    input: json!({ "model": "demo", "messages": [{ "role": "user", "content": format!("Say hello to {id}") }] }),
                    webhook_url: consumer.url(),
                    schedule: Default::default(),
                }))
                .await?;
            ids.push((group, id));
        }
    }

    let start = Instant::now();
    loop {
        let mut finished = 0;
        for (_, id) in &ids {
            if store
                .jobs()
                .get(id)
                .await?
                .is_some_and(|j| j.state.is_terminal())
            {
                finished += 1;
            }
        }
        println!(
            "  {finished}/{total} jobs finished after {:.1} s",
            start.elapsed().as_secs_f64()
        );
        if finished == total {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(60),
            "jobs did not finish within a minute"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    engine.shutdown();

    println!();
    println!(
        "{:<30} {:>5} {:>6} {:>11} {:>10} {:>9} {:>14} {:>11}",
        "fault",
        "jobs",
        "acked",
        "model work",
        "model reqs",
        "webhooks",
        "delivery keys",
        "duplicates"
    );
    let mut all_once = true;
    for group in GROUPS {
        let mine: Vec<&String> = ids
            .iter()
            .filter(|(g, _)| g.prefix == group.prefix)
            .map(|(_, id)| id)
            .collect();
        let mut acked = 0;
        let (mut work, mut model_requests, mut webhooks, mut duplicates) = (0, 0, 0, 0);
        let mut keys = HashSet::new();
        for id in &mine {
            if store
                .jobs()
                .get(id)
                .await?
                .is_some_and(|j| j.state == JobState::Acked)
            {
                acked += 1;
            }
            let key = format!("job:{id}:generate");
            work += provider.work_done(&key);
            model_requests += provider.requests_for(&key);
            let deliveries = consumer.deliveries_for(id);
            webhooks += deliveries.len();
            duplicates += deliveries.iter().filter(|d| d.duplicate).count();
            keys.extend(deliveries.iter().filter_map(|d| d.webhook_id.clone()));
            all_once &= provider.work_done(&key) == 1 && consumer.processed_for(id) == 1;
        }
        println!(
            "{:<30} {:>5} {:>6} {:>11} {:>10} {:>9} {:>14} {:>11}",
            group.name,
            mine.len(),
            acked,
            work,
            model_requests,
            webhooks,
            keys.len(),
            duplicates
        );
    }
    println!();
    println!(
        "model work: done once per job, whatever the requests; webhooks: one delivery key per job, \
         repeats carry the same key and the consumer dropped them as duplicates."
    );
    if let Some((admin_url, name)) = admin {
        drop(store);
        let mut conn =
            <diesel_async::AsyncPgConnection as diesel_async::AsyncConnection>::establish(
                &admin_url,
            )
            .await?;
        let _ = diesel_async::SimpleAsyncConnection::batch_execute(
            &mut conn,
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )
        .await;
    }
    anyhow::ensure!(
        all_once,
        "a job's model work or delivery was not exactly once: see the table"
    );
    Ok(())
}
