//! Starting a node: the supervisor, the LISTEN/NOTIFY wake-up, and the shared
//! parts every job actor uses.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;

use onceflow_observability::Telemetry;

use crate::faults::Faults;
use crate::provider::{Provider, ProviderConfig};
use crate::retry::RetryPolicy;
use crate::store::jobs::NEW_JOB_CHANNEL;
use crate::store::Store;
use crate::supervisor::{Counters, InFlight, Poll, Shutdown, Supervisor};
use crate::webhook::WebhookSecret;
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
    pub limits: crate::limits::Limits,
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
    /// Where webhooks and tools may send (default: public addresses only).
    pub url_guard: crate::guard::UrlGuard,
    /// Largest tool or step answer read (default 1 MiB).
    pub tool_response_limit: usize,
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
            url_guard: crate::guard::UrlGuard::strict(),
            tool_response_limit: 1 << 20,
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
    pub(crate) limiter: Arc<crate::limits::Limiter>,
    /// Whether intake may hand this node a new job (see [`crate::handoff`]).
    pub(crate) gate: crate::handoff::Gate,
    /// The signing secrets of the tokens whose jobs this node delivered lately.
    signing: std::sync::Mutex<HashMap<i64, ReadSecret>>,
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
        // Webhooks and tools go to URLs callers and models choose: no
        // redirects, and names resolved through the SSRF guard.
        // No proxy from the environment either: a proxy resolves the name
        // itself, past the guard.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .retry(no_hidden_retries())
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(crate::guard::GuardedResolver::new(config.url_guard.clone()))
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
            limiter: Arc::new(crate::limits::Limiter::new(config.limits.clone())),
            store,
            registry,
            config,
            client,
            faults,
            counters: Arc::new(Counters::default()),
            draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            gate: Default::default(),
            signing: Default::default(),
            node_secret: config_secret,
        }
    }

    /// The secrets that sign webhooks of a job submitted by API token
    /// `owner`: the token's own (read again at most every 30 s, so a
    /// rotation takes effect within that), else the node's
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
        if let Some((read, secret)) = self.signing.lock().expect("lock").get(&owner) {
            if read.elapsed() < fresh {
                return Ok(secret.clone().or_else(|| self.node_secret.clone()));
            }
        }
        let secret = match self.store.token_secret_of(owner).await? {
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

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A running node. Must be started inside an actix `System`.
pub struct Engine {
    supervisor: Addr<Supervisor>,
    handoff: crate::handoff::Handoff,
    store: Store,
    node_id: String,
    stop_listener: tokio::sync::watch::Sender<bool>,
    counters: Arc<Counters>,
    draining: Arc<std::sync::atomic::AtomicBool>,
    limiter: Arc<crate::limits::Limiter>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the supervisor and the new-job listener.
    pub fn start(store: Store, registry: Registry, faults: Faults, config: EngineConfig) -> Engine {
        let node_id = config.node_id.clone();
        // Every series at zero from the start, so dashboards see the first increment.
        let names: Vec<&str> = registry.names().collect();
        config.telemetry.metrics().zero(&names);
        let shared = Arc::new(Shared::new(store.clone(), registry, faults, config));
        let counters = shared.counters.clone();
        let draining = shared.draining.clone();
        let limiter = shared.limiter.clone();
        // Provider slots held under this node's name belong to its previous
        // life: no call of this one holds any yet.
        let slots = store.clone();
        let node = node_id.clone();
        actix::spawn(async move {
            if let Err(e) = slots.release_node_slots(&node).await {
                tracing::warn!(error = %e, "could not free this node's old provider slots");
            }
        });
        let supervisor = Supervisor::new(shared.clone()).start();
        let handoff = crate::handoff::Handoff::new(shared, supervisor.clone());
        let (stop_listener, stopped) = tokio::sync::watch::channel(false);
        actix::spawn(listen(
            store.clone(),
            supervisor.clone(),
            limiter.clone(),
            stopped,
        ));
        Engine {
            limiter,
            handoff,
            supervisor,
            store,
            node_id,
            stop_listener,
            counters,
            draining,
        }
    }

    /// The supervisor's address.
    pub fn supervisor(&self) -> &Addr<Supervisor> {
        &self.supervisor
    }

    /// Where this node's intake hands new jobs (give it to the API's
    /// state, [`crate::api::ApiState::handoff`], on a node that runs both).
    pub fn handoff(&self) -> crate::handoff::Handoff {
        self.handoff.clone()
    }

    /// Look for work now.
    pub fn wake(&self) {
        self.supervisor.do_send(Poll);
    }

    /// Jobs running on this node.
    pub async fn in_flight(&self) -> usize {
        self.supervisor.send(InFlight).await.unwrap_or(0)
    }

    /// What the supervisor has counted (attempts started, takeovers, leases lost, renewals).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Aborts every attempt, as a crash would: their leases lapse and
    /// another node resumes them after the lease.
    pub fn shutdown(&self) {
        let _ = self.stop_listener.send(true);
        self.supervisor.do_send(Shutdown);
    }

    /// Drains the node: takes no new work, lets every attempt finish the
    /// request it has in flight and record it (so no provider or consumer is
    /// asked twice for a deploy), starts no new side effect, then — once all
    /// attempts stopped, or after `timeout` — aborts what is left and
    /// releases the node's leases, so another node resumes the jobs at once.
    /// Returns how many leases were released.
    pub async fn drain(
        &self,
        timeout: std::time::Duration,
    ) -> Result<usize, crate::error::StoreError> {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = self.stop_listener.send(true);
        // Calls waiting for a provider limit give up now, not at their timer.
        self.limiter.wake_all();
        let _ = self.supervisor.send(crate::supervisor::Drain).await;
        let deadline = tokio::time::Instant::now() + timeout;
        // Hand-offs already committed are adopted (and then drained) or
        // left to the lease release below, never to lapse unseen.
        while (self.in_flight().await > 0 || self.handoff.reserved() > 0)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let left = self.in_flight().await;
        if left > 0 {
            tracing::warn!(left, "drain timed out; aborting the attempts still running");
        }
        let _ = self.supervisor.send(Shutdown).await;
        self.store.release_leases(&self.node_id).await
    }

    /// Whether [`drain`](Self::drain) has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Aborts every attempt and releases their leases, so another node (or
    /// this one restarted) resumes them at once from their last checkpoint.
    pub async fn shutdown_gracefully(&self) -> Result<usize, crate::error::StoreError> {
        let _ = self.stop_listener.send(true);
        let _ = self.supervisor.send(Shutdown).await;
        self.store.release_leases(&self.node_id).await
    }
}

/// Wakes the supervisor on every `NOTIFY` of a new job; reconnects on
/// failure with backoff (100 ms doubling to 5 s, reset once a connection
/// has listened), so a database that is down is not hammered. Polling
/// carries on meanwhile.
async fn listen(
    store: Store,
    supervisor: Addr<Supervisor>,
    limiter: Arc<crate::limits::Limiter>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    const FIRST: Duration = Duration::from_millis(100);
    let mut backoff = FIRST;
    loop {
        let attempt = async {
            match store.db().dedicated().await {
                Ok(mut conn) => {
                    let started = std::time::Instant::now();
                    if let Err(e) = listen_on(&mut conn, &store, &supervisor, &limiter).await {
                        tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                    }
                    started.elapsed() > Duration::from_secs(5)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open the LISTEN connection; polling only");
                    false
                }
            }
        };
        let listened = tokio::select! {
            listened = attempt => listened,
            _ = stopped.changed() => return,
        };
        if !supervisor.connected() {
            return;
        }
        if listened {
            backoff = FIRST;
        }
        // Anything missed meanwhile is found by the next poll.
        supervisor.do_send(Poll);
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn listen_on(
    conn: &mut AsyncPgConnection,
    store: &Store,
    supervisor: &Addr<Supervisor>,
    limiter: &crate::limits::Limiter,
) -> Result<(), diesel::result::Error> {
    use crate::store::limits::LIMITS_CHANNEL;
    use crate::store::operate::CANCEL_CHANNEL;
    use crate::store::streams::STREAM_CHANNEL;
    conn.batch_execute(&format!(
        "LISTEN {NEW_JOB_CHANNEL}; LISTEN {LIMITS_CHANNEL}; LISTEN {STREAM_CHANNEL}; LISTEN {CANCEL_CHANNEL}"
    ))
    .await?;
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    while let Some(n) = notifications.next().await {
        let n = n?;
        if n.channel == LIMITS_CHANNEL {
            limiter.wake(&n.payload);
        } else if n.channel == STREAM_CHANNEL {
            store.stream_moved(&n.payload);
        } else if n.channel == CANCEL_CHANNEL {
            supervisor.do_send(crate::supervisor::Cancelled(n.payload));
        } else {
            supervisor.do_send(Poll);
        }
    }
    Ok(())
}

/// reqwest keeps a copy of every request's headers to resend one an HTTP/2
/// server refused unprocessed. Over HTTP/1.1 that resend never happens, so
/// the clients that speak it (webhooks and tools, an HTTP/1.1 provider) do
/// without the copy.
fn no_hidden_retries() -> reqwest::retry::Builder {
    reqwest::retry::never().max_retries_per_request(0)
}
