//! Starting a node: the supervisor, the LISTEN/NOTIFY wake-up, and the HTTP
//! state intake hands jobs through. The top of the engine: it wires every
//! layer below it together.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;

use crate::faults::Faults;
use crate::node::shared::{Counters, EngineConfig, Shared};
use crate::node::supervisor::{InFlight, Poll, Shutdown, Supervisor};
use crate::store::Store;
use crate::workflow::Registry;

/// A running node. Must be started inside an actix `System`.
pub struct Engine {
    supervisor: Addr<Supervisor>,
    handoff: crate::node::handoff::Handoff,
    store: Store,
    node_id: String,
    stop_listener: tokio::sync::watch::Sender<bool>,
    counters: Arc<Counters>,
    draining: Arc<std::sync::atomic::AtomicBool>,
    limiter: Arc<crate::limiter::Limiter>,
    shared: Arc<Shared>,
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
            if let Err(e) = slots.limits().release_node_slots(&node).await {
                tracing::warn!(error = %e, "could not free this node's old provider slots");
            }
        });
        let supervisor = Supervisor::new(shared.clone()).start();
        let handoff = crate::node::handoff::Handoff::new(shared.clone(), supervisor.clone());
        let (stop_listener, stopped) = tokio::sync::watch::channel(false);
        actix::spawn(listen(
            store.clone(),
            shared.hub.clone(),
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
            shared,
        }
    }

    /// The supervisor's address.
    pub fn supervisor(&self) -> &Addr<Supervisor> {
        &self.supervisor
    }

    /// Where this node's intake hands new jobs (give it to the API's
    /// state, [`crate::api::ApiState::handoff`], on a node that runs both).
    pub fn handoff(&self) -> crate::node::handoff::Handoff {
        self.handoff.clone()
    }

    /// This node's watchers of streamed jobs and of token changes (give it
    /// to the API's state, [`crate::api::ApiState::hub`], on a node that
    /// runs both).
    pub fn hub(&self) -> Arc<crate::hub::Hub> {
        self.shared.hub.clone()
    }

    /// Look for work now.
    pub fn wake(&self) {
        self.supervisor.do_send(Poll);
    }

    /// Purges the jobs past their retention now, rather than when the
    /// oldest finished job's retention ends (the node's own timer): for an
    /// operator, or a test, that changed `finished_at` behind its back.
    pub fn purge_now(&self) {
        self.supervisor.do_send(crate::node::supervisor::PurgeNow);
    }

    /// Reads the job gauges (`onceflow.jobs`, `onceflow.jobs.unrunnable`)
    /// into this node's telemetry now, as a `/metrics` scrape does: for an
    /// embedder that renders [`Telemetry::prometheus`] itself.
    ///
    /// [`Telemetry::prometheus`]: onceflow_observability::Telemetry::prometheus
    pub async fn refresh_gauges(&self) {
        let shared = &self.shared;
        crate::node::shared::refresh_gauges(
            &shared.store,
            &shared.registry,
            &shared.config.telemetry,
        )
        .await
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
        let _ = self.supervisor.send(crate::node::supervisor::Drain).await;
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
        self.store.leases().release_all(&self.node_id).await
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
        self.store.leases().release_all(&self.node_id).await
    }
}

/// Wakes the supervisor on every `NOTIFY` of a new job; reconnects on
/// failure with backoff (100 ms doubling to 5 s, reset once a connection
/// has listened), so a database that is down is not hammered. Polling
/// carries on meanwhile.
async fn listen(
    store: Store,
    hub: Arc<crate::hub::Hub>,
    supervisor: Addr<Supervisor>,
    limiter: Arc<crate::limiter::Limiter>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    const FIRST: Duration = Duration::from_millis(100);
    let mut backoff = FIRST;
    loop {
        let attempt = async {
            match store.db().dedicated().await {
                Ok(mut conn) => {
                    let started = std::time::Instant::now();
                    if let Err(e) = listen_on(&mut conn, &hub, &supervisor, &limiter).await {
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
    hub: &crate::hub::Hub,
    supervisor: &Addr<Supervisor>,
    limiter: &crate::limiter::Limiter,
) -> Result<(), diesel::result::Error> {
    use crate::store::Channel;
    let listen: Vec<String> = Channel::ALL
        .iter()
        .map(|c| format!("LISTEN {}", c.name()))
        .collect();
    conn.batch_execute(&listen.join("; ")).await?;
    // Listening from here on: what was announced before (while this
    // connection was down, or before the first) is looked for once.
    supervisor.do_send(crate::node::supervisor::Listening);
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    while let Some(n) = notifications.next().await {
        let n = n?;
        match Channel::parse(&n.channel) {
            Some(Channel::Limits) => limiter.wake(&n.payload),
            Some(Channel::Stream) => hub.moved(&n.payload),
            Some(Channel::Cancelled) => {
                supervisor.do_send(crate::node::supervisor::Cancelled(n.payload))
            }
            Some(Channel::Tokens) => hub.token_changed(&n.payload),
            Some(Channel::Schedules) => {
                supervisor.do_send(crate::node::supervisor::SchedulesChanged)
            }
            Some(Channel::Events) => supervisor.do_send(crate::node::supervisor::SendEvents),
            Some(Channel::NewJob) | None => supervisor.do_send(Poll),
        }
    }
    Ok(())
}
