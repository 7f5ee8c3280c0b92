//! [`TestEnv`]: a fresh database, a fake provider and consumer, failpoints,
//! and engines started on them.

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{database, FakeConsumer, FakeProvider};
use std::sync::Arc;

use crate::db::Db;
use crate::faults::Faults;
use crate::node::actor::{JobRun, Outcome};
use crate::node::intake::NewJob;
use crate::node::runtime::Engine;
use crate::node::shared::EngineConfig;
use crate::node::shared::Shared;
use crate::rules::lifecycle::JobState;
use crate::rules::retry::RetryPolicy;
use crate::store::Leased;
use crate::store::{Intake, JobView, Store};
use crate::workflow::Registry;

/// Everything a test of the engine needs, on real Postgres and real HTTP.
#[derive(Debug)]
pub struct TestEnv {
    /// The URL of this test's fresh database.
    pub db_url: String,
    /// The store on it.
    pub store: Store,
    /// The fake model provider.
    pub provider: FakeProvider,
    /// The fake webhook consumer.
    pub consumer: FakeConsumer,
    /// The failpoints shared with every engine the test starts.
    pub faults: Faults,
    /// The watchers shared by every engine the test starts ([`Self::start`])
    /// and the API it serves, as one node's are.
    pub hub: std::sync::Arc<crate::hub::Hub>,
}

impl TestEnv {
    /// A fresh database and fresh fakes. Call inside an actix System
    /// (`#[actix_rt::test]`) to start engines.
    pub async fn new() -> Self {
        let db_url = database::fresh().await;
        let db = Db::connect(&db_url, 8)
            .await
            .expect("connect to the test database");
        TestEnv {
            db_url,
            store: Store::new(db),
            provider: FakeProvider::start(),
            consumer: FakeConsumer::start(),
            faults: Faults::new(),
            hub: Default::default(),
        }
    }

    /// An engine configuration with test timings: a 1 s lease, 50 ms polls,
    /// 20 ms retry backoff, 2 s request timeouts, pointed at the fakes.
    pub fn config(&self) -> EngineConfig {
        let mut config = EngineConfig {
            node_id: format!("test-node-{}", rand::random::<u32>()),
            lease: Duration::from_millis(1000),
            poll_interval: Duration::from_millis(50),
            max_in_flight: 100,
            wait_poll: Duration::from_millis(20),
            webhook_timeout: Duration::from_secs(2),
            model_retry: RetryPolicy {
                base: Duration::from_millis(20),
                max: Duration::from_millis(200),
                retry_after_cap: Duration::from_secs(5),
                budget: 6,
            },
            webhook_retry: RetryPolicy {
                base: Duration::from_millis(20),
                max: Duration::from_millis(200),
                retry_after_cap: Duration::from_secs(5),
                budget: 6,
            },
            // The fakes live on loopback: tests open the SSRF guard
            // explicitly (one test checks that the default refuses them).
            url_guard: crate::net::guard::UrlGuard::allow_private(),
            ..EngineConfig::default()
        };
        config.provider.base_url = self.provider.base_url();
        config.provider.anthropic_base_url = self.provider.anthropic_base_url();
        config.provider.timeout = Duration::from_secs(2);
        config
    }

    /// Starts an engine (a node) with these workflows and `config`; it
    /// shares the test's hub with the API the test serves.
    pub fn start(&self, registry: Registry, config: EngineConfig) -> Engine {
        let config = EngineConfig {
            hub: self.hub.clone(),
            ..config
        };
        Engine::start(self.store.clone(), registry, self.faults.clone(), config)
    }

    /// Submits a `completion` job with one user message, as the API would.
    pub async fn submit(&self, id: &str, prompt: &str) -> JobView {
        self.submit_job(NewJob {
            tags: Default::default(),
            id: id.to_owned(),
            workflow: "completion".to_owned(),
            workflow_version: 1,
            input: json!({ "model": "test-model", "messages": [{ "role": "user", "content": prompt }] }),
            webhook_url: self.consumer.url(),
            schedule: Default::default(),
        })
        .await
    }

    /// Submits any job; panics unless it is new.
    pub async fn submit_job(&self, job: NewJob) -> JobView {
        let submitted = self
            .store
            .jobs()
            .submit(&crate::store::Submission::new(&job))
            .await
            .expect("submit");
        match submitted.intake {
            Intake::Created(view) => view,
            other => panic!("job {} was not new: {other:?}", job.id),
        }
    }

    /// The job as the API shows it.
    pub async fn job(&self, id: &str) -> JobView {
        let view = self
            .store
            .jobs()
            .get(id)
            .await
            .expect("load job")
            .expect("job exists");
        // Every `waiting` a test sees is one the wait machine's type reads
        // (those SQL writes or computes included).
        if let Some(waiting) = &view.waiting {
            assert!(
                crate::rules::wait_machine::Waiting::from_json(waiting).is_some(),
                "job {id}'s waiting is no Waiting: {waiting}"
            );
        }
        view
    }

    /// Waits until job `id` is in `state`; panics with the job after `timeout`.
    pub async fn wait_for(&self, id: &str, state: JobState, timeout: Duration) -> JobView {
        let ok = wait_until(timeout, || async {
            self.store
                .jobs()
                .get(id)
                .await
                .ok()
                .flatten()
                .is_some_and(|j| j.state == state)
        })
        .await;
        let job = self.job(id).await;
        assert!(
            ok,
            "job {id} did not reach {state} within {timeout:?}: {job:#?}"
        );
        job
    }

    /// Runs one SQL statement on the test database (to set a job up in any
    /// state, or to inspect it).
    pub async fn sql(&self, sql: &str) -> Value {
        use diesel_async::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Jsonb)]
            v: Value,
        }
        let mut conn = self.store.db().conn().await.expect("conn");
        let wrapped =
            format!("SELECT coalesce(jsonb_agg(to_jsonb(q)), '[]'::jsonb) AS v FROM ({sql}) q");
        diesel::sql_query(wrapped)
            .get_result::<Row>(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .v
    }

    /// Leases the one runnable job of this test's database as `node`,
    /// bypassing the supervisor (to run attempts by hand).
    pub async fn lease(&self, node: &str, lease: Duration) -> Leased {
        let mut leased = self
            .store
            .leases()
            .acquire(node, 1, lease.as_millis() as i64, false, None, &[])
            .await
            .expect("acquire");
        assert_eq!(leased.len(), 1, "expected exactly one runnable job");
        leased.remove(0)
    }

    /// Runs one attempt of `leased` to its end, without an actor or a
    /// supervisor: no heartbeat, and nothing stops it but the database. Two
    /// of these with the same `Leased` are two attempts that both believe
    /// they hold the lease.
    pub async fn run_attempt(
        &self,
        registry: &Registry,
        leased: Leased,
        config: EngineConfig,
    ) -> Outcome {
        let workflow = registry
            .get_version(&leased.workflow, leased.workflow_version)
            .cloned()
            .unwrap_or_else(|| panic!("workflow {} is not registered", leased.workflow));
        let config = EngineConfig {
            hub: self.hub.clone(),
            ..config
        };
        let shared = Arc::new(Shared::new(
            self.store.clone(),
            registry.clone(),
            self.faults.clone(),
            config,
        ));
        JobRun::new(leased, workflow, shared).execute().await
    }

    /// Runs a statement that returns no rows.
    pub async fn execute(&self, sql: &str) -> usize {
        use diesel_async::RunQueryDsl;
        let mut conn = self.store.db().conn().await.expect("conn");
        diesel::sql_query(sql)
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes; true if it held.
pub async fn wait_until<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
