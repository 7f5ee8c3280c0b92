//! A node's configuration and the parts every job actor of the node shares:
//! the store, the registry, the clients, the limiter, the hand-off gate and
//! the counters. Below the actor, the supervisor and the hand-off, which all
//! hold an `Arc<Shared>`; the node is started by [`crate::node::runtime`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use onceflow_observability::Telemetry;

use crate::faults::Faults;
use crate::net::provider::{Provider, ProviderConfig};
use crate::net::webhook::WebhookSecret;
use crate::rules::retry::RetryPolicy;
use crate::store::Store;
use crate::workflow::Registry;

/// How a node runs jobs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This node's name, recorded as the lease owner and on history rows.
    pub node_id: String,
    /// The lease (visibility timeout); renewed every third of it while a job runs.
    pub lease: Duration,
    /// How often the supervisor looks for work without being woken.
    pub poll_interval: Duration,
    /// Jobs this node runs at once.
    pub max_in_flight: usize,
    /// How often a step waiting on a concurrent attempt looks again.
    pub wait_poll: Duration,
    /// The model provider: endpoint, key and per-call timeout.
    pub provider: ProviderConfig,
    /// Provider limits (`ONCEFLOW_LIMITS`), shared by every node.
    pub limits: crate::rules::quota::Limits,
    /// How long one webhook send may take (also bounds each tool call); default 10 s.
    pub webhook_timeout: Duration,
    /// Signs each webhook (`webhook-signature` header); `None` sends them unsigned.
    pub webhook_secret: Option<WebhookSecret>,
    /// Backoff and budget of model calls.
    pub model_retry: RetryPolicy,
    /// Backoff and budget of webhook sends.
    pub webhook_retry: RetryPolicy,
    /// Finished jobs (with their keys and ledgers) are purged this long after
    /// they finished; a resubmission of a purged id is a new job.
    pub retention: Duration,
    /// Dead letters are kept this long (default 7 days), so they can be
    /// redriven after finished jobs are gone.
    pub dead_retention: Duration,
    /// Spans and metrics (OTLP export when configured; `/metrics` always).
    pub telemetry: Arc<Telemetry>,
    /// This node's watchers of streamed jobs and of token changes, shared
    /// with the node's API ([`crate::api::ApiState::hub`]).
    pub hub: Arc<crate::hub::Hub>,
    /// Where webhooks and tools may send (default: public addresses only).
    pub url_guard: crate::net::guard::UrlGuard,
    /// Largest tool or step answer read (default 1 MiB).
    pub tool_response_limit: usize,
    /// Unfinished jobs per API token above which a schedule's fire time
    /// makes no job (recorded `skipped`), as a submit would be refused
    /// (`ONCEFLOW_MAX_BACKLOG_PER_TOKEN`); `None`: no bound.
    pub max_backlog_per_token: Option<u64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            node_id: default_node_id(),
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            max_in_flight: 1000,
            wait_poll: Duration::from_millis(200),
            provider: ProviderConfig::default(),
            limits: Default::default(),
            webhook_timeout: Duration::from_secs(10),
            webhook_secret: None,
            model_retry: RetryPolicy::DEFAULT_MODEL,
            webhook_retry: RetryPolicy::DEFAULT_WEBHOOK,
            retention: Duration::from_secs(24 * 3600),
            dead_retention: Duration::from_secs(7 * 24 * 3600),
            telemetry: Arc::new(Telemetry::disabled()),
            hub: Arc::default(),
            url_guard: crate::net::guard::UrlGuard::strict(),
            tool_response_limit: 1 << 20,
            max_backlog_per_token: Some(10_000),
        }
    }
}

/// `host:pid`, unique among live processes.
pub fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "node".to_owned());
    format!("{host}:{}", std::process::id())
}

/// A child job's checks against this node's workflows and SSRF guard.
struct NodeChildRules {
    registry: Registry,
    guard: crate::net::guard::UrlGuard,
}

impl std::fmt::Debug for NodeChildRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeChildRules").finish_non_exhaustive()
    }
}

impl crate::context::ChildRules for NodeChildRules {
    fn check(
        &self,
        workflow: &str,
        input: &serde_json::Value,
        webhook_url: Option<&str>,
    ) -> Result<(i32, bool), crate::error::InvalidInput> {
        let Some(w) = self.registry.get(workflow) else {
            let known: Vec<_> = self.registry.names().collect();
            return Err(crate::error::InvalidInput::new(
                "workflow",
                format!(
                    "unknown workflow {workflow:?}; registered: {}",
                    known.join(", ")
                ),
            ));
        };
        if !input.is_object() {
            return Err(crate::error::InvalidInput::new(
                "input",
                "must be a JSON object",
            ));
        }
        // Not `validate_here`: a replay on a node whose tools differ must
        // still find the child it started (the body checks its own rules).
        w.validate_input(input)?;
        if let Some(url) = webhook_url {
            crate::request::validate_webhook_url(url, &self.guard)?;
        }
        Ok((w.version() as i32, self.registry.failure_events(workflow)))
    }
}

/// A token's signing secret as read at an instant (`None`: it has none).
type ReadSecret = (std::time::Instant, Option<Arc<WebhookSecret>>);

/// What every actor of a node shares.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) registry: Registry,
    pub(crate) config: EngineConfig,
    pub(crate) provider: Arc<Provider>,
    pub(crate) client: reqwest::Client,
    pub(crate) faults: Faults,
    pub(crate) counters: Arc<Counters>,
    /// Set by [`Engine::drain`]: attempts start no new side effect.
    pub(crate) draining: Arc<std::sync::atomic::AtomicBool>,
    /// Provider limits and the wake-up of calls waiting on one.
    pub(crate) limiter: Arc<crate::limiter::Limiter>,
    /// What a child job must pass to start (see [`crate::context::ChildRules`]).
    pub(crate) child_rules: Arc<dyn crate::context::ChildRules>,
    /// Whether intake may hand this node a new job (see [`crate::node::handoff`]).
    pub(crate) gate: Gate,
    /// The signing secrets of the tokens whose jobs this node delivered lately.
    signing: std::sync::Mutex<HashMap<i64, ReadSecret>>,
    /// This node's watchers of streamed jobs and of token changes.
    pub(crate) hub: Arc<crate::hub::Hub>,
    /// Tokens whose secret changed (a rotation announced by `NOTIFY`):
    /// their cached secrets are read again.
    token_changes: std::sync::Mutex<tokio::sync::broadcast::Receiver<i64>>,
    /// The node's own secret (`ONCEFLOW_WEBHOOK_SECRET`).
    node_secret: Option<Arc<WebhookSecret>>,
}

impl Shared {
    pub(crate) fn new(
        store: Store,
        registry: Registry,
        faults: Faults,
        config: EngineConfig,
    ) -> Self {
        let hub = config.hub.clone();
        let token_changes = std::sync::Mutex::new(hub.token_changes());
        let child_rules = Arc::new(NodeChildRules {
            registry: registry.clone(),
            guard: config.url_guard.clone(),
        });
        // Webhooks and tools go to URLs callers and models choose: no
        // redirects, and names resolved through the SSRF guard.
        // No proxy from the environment either: a proxy resolves the name
        // itself, past the guard.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .retry(no_hidden_retries())
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(crate::net::guard::GuardedResolver::new(
                config.url_guard.clone(),
            ))
            .build()
            .expect("the HTTP client builds");
        // The provider is the operator's own: a client of its own, unguarded
        // (HTTP/2 only when it speaks h2c).
        let provider_client = if config.provider.h2c {
            // HTTP/2 keeps reqwest's resend of a request the server refused
            // unprocessed (`REFUSED_STREAM`, past a graceful `GOAWAY`): the
            // protocol says it was not processed, so resending at once is
            // right, where onceflow's own retry would count an ambiguous
            // attempt and back off.
            reqwest::Client::builder()
                .http2_prior_knowledge()
                .build()
                .expect("the HTTP/2 client builds")
        } else {
            reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .retry(no_hidden_retries())
                .build()
                .expect("the HTTP client builds")
        };
        let config_secret = config.webhook_secret.clone().map(Arc::new);
        Shared {
            provider: Arc::new(Provider::new(provider_client, config.provider.clone())),
            limiter: Arc::new(crate::limiter::Limiter::new(config.limits.clone())),
            store,
            registry,
            config,
            client,
            faults,
            counters: Arc::new(Counters::default()),
            draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            gate: Default::default(),
            signing: Default::default(),
            token_changes,
            hub,
            child_rules,
            node_secret: config_secret,
        }
    }

    /// The secrets that sign webhooks of a job submitted by API token
    /// `owner`: the token's own (read again after a rotation announced by
    /// `NOTIFY`, and at least every 30 s should that be missed), else the node's
    /// `ONCEFLOW_WEBHOOK_SECRET` (development mode, admin tokens, tokens
    /// made before tokens had their own).
    pub(crate) async fn signing_secret(
        &self,
        owner: Option<i64>,
    ) -> Result<Option<Arc<WebhookSecret>>, crate::error::StoreError> {
        let Some(owner) = owner else {
            return Ok(self.node_secret.clone());
        };
        let fresh = std::time::Duration::from_secs(30);
        self.forget_changed_secrets();
        if let Some((read, secret)) = self.signing.lock().expect("lock").get(&owner) {
            if read.elapsed() < fresh {
                return Ok(secret.clone().or_else(|| self.node_secret.clone()));
            }
        }
        let secret = match self.store.tokens().secret_of(owner).await? {
            Some(text) => match text.parse::<WebhookSecret>() {
                Ok(secret) => Some(Arc::new(secret)),
                Err(e) => {
                    tracing::error!(token = owner, error = %e, "a token's stored signing secret does not parse; signing with the node's");
                    None
                }
            },
            None => None,
        };
        self.signing
            .lock()
            .expect("lock")
            .insert(owner, (std::time::Instant::now(), secret.clone()));
        Ok(secret.or_else(|| self.node_secret.clone()))
    }

    /// Drops the cached secrets of tokens announced as changed.
    fn forget_changed_secrets(&self) {
        use tokio::sync::broadcast::error::TryRecvError;
        let mut changes = self.token_changes.lock().expect("lock");
        loop {
            match changes.try_recv() {
                Ok(id) => {
                    self.signing.lock().expect("lock").remove(&id);
                }
                Err(TryRecvError::Lagged(_)) => self.signing.lock().expect("lock").clear(),
                Err(TryRecvError::Empty | TryRecvError::Closed) => return,
            }
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// reqwest keeps a copy of every request's headers to resend one an HTTP/2
/// server refused unprocessed. Over HTTP/1.1 that resend never happens, so
/// the clients that speak it (webhooks and tools, an HTTP/1.1 provider) do
/// without the copy.
fn no_hidden_retries() -> reqwest::retry::Builder {
    reqwest::retry::never().max_retries_per_request(0)
}

/// Counts of what the supervisor has done, for tests and `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Attempts started on this node.
    pub started: std::sync::atomic::AtomicU64,
    /// Of them, jobs resumed from another owner's expired lease.
    pub takeovers: std::sync::atomic::AtomicU64,
    /// Attempts that ended because another attempt took the lease.
    pub lease_lost: std::sync::atomic::AtomicU64,
    /// Lease-renewal statements sent (one per heartbeat, whatever the number of jobs).
    pub renewals: std::sync::atomic::AtomicU64,
    /// Leases renewed by them.
    pub renewed_leases: std::sync::atomic::AtomicU64,
}

/// What intake and the supervisor share to decide a hand-off.
#[derive(Debug)]
pub(crate) struct Gate {
    /// Hand-offs reserved and not yet adopted by the supervisor.
    pub(crate) reserved: AtomicUsize,
    /// Actors the supervisor runs.
    pub(crate) running: AtomicUsize,
    /// Hand-offs allowed: the room the last acquire left over (it found
    /// nothing more runnable, so a new job jumps no queue). An acquire in
    /// progress leaves this much room to hand-offs; zero after one that
    /// filled what it asked for (older work may be waiting), and before
    /// the first.
    pub(crate) budget: AtomicUsize,
    /// The supervisor stops or drains: no hand-off.
    pub(crate) closed: AtomicBool,
    /// Jobs being handed to this node: inserted leased (or about to be),
    /// their `Adopt` not yet handled. An acquire never takes these back as
    /// its own (`ReclaimOwn`), so one job never gets two actors here.
    pub(crate) handing: std::sync::Mutex<std::collections::HashSet<String>>,
    /// An acquire that takes back this node's own leases has read
    /// `handing` and not yet answered: no hand-off starts meanwhile (its
    /// lease, written after that read, would be taken back under a newer
    /// epoch while its first actor runs). Read and written under the
    /// `handing` lock.
    pub(crate) reclaiming: AtomicBool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            reserved: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            budget: AtomicUsize::new(0),
            handing: Default::default(),
            reclaiming: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }
}

/// Reads the `onceflow.jobs` (live jobs by state, and the dead) and
/// `onceflow.jobs.unrunnable` gauges from the database: two statements.
/// They run when the metrics are collected — a `/metrics` scrape, and each
/// OTLP push when OTLP metrics are on — never on an idle node's own clock.
/// A failed read keeps the last values.
pub async fn refresh_gauges(store: &Store, registry: &Registry, telemetry: &Telemetry) {
    let metrics = telemetry.metrics();
    match store.retention().count_live_and_dead().await {
        Ok(counts) => {
            for (state, n) in counts {
                metrics.jobs.record(
                    n,
                    &[opentelemetry::KeyValue::new(
                        onceflow_observability::names::STATE,
                        state.as_str(),
                    )],
                );
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not count jobs by state"),
    }
    match store
        .retention()
        .count_unrunnable(&registry.runnable())
        .await
    {
        Ok(n) => metrics.jobs_unrunnable.record(n, &[]),
        Err(e) => tracing::debug!(error = %e, "could not count unrunnable jobs"),
    }
    match store.waits().spend_today(None).await {
        Ok(spend) => {
            for s in spend {
                let token = [opentelemetry::KeyValue::new(
                    onceflow_observability::names::TOKEN,
                    s.token,
                )];
                metrics
                    .budget_spent
                    .record(s.spent_today.max(0) as u64, &token);
                metrics
                    .budget_limit
                    .record(s.daily_budget.max(0) as u64, &token);
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not read the budgets' spend"),
    }
}
