//! `onceflow serve` and `onceflow migrate`.

use std::sync::Arc;

use anyhow::Context as _;
use onceflow_engine::api::{self, ApiState};
use onceflow_engine::{Engine, Faults, Store};
use onceflow_observability::Telemetry;

use super::config::{DbArgs, ServeArgs};

pub fn run(args: ServeArgs, mut registry: onceflow_engine::Registry) -> anyhow::Result<()> {
    let mut config = args.engine_config()?;
    let telemetry = Arc::new(
        Telemetry::from_env_for_node(&config.node_id).context("OpenTelemetry configuration")?,
    );
    match telemetry.otlp() {
        Some(otlp) => tracing::info!(
            traces = otlp.traces.as_deref().unwrap_or("off"),
            metrics = otlp.metrics.as_deref().unwrap_or("off"),
            "exporting OpenTelemetry over OTLP/HTTP"
        ),
        None => tracing::info!("OTLP export is off (set OTEL_EXPORTER_OTLP_ENDPOINT to export); /metrics serves Prometheus text"),
    }
    config.telemetry = telemetry.clone();
    // The port first: a node that cannot listen exits before it starts the
    // embedded PostgreSQL, takes a name or starts actors.
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("binding {}", args.listen))?;
    let database = args.db.resolve()?;
    let result = actix_web::rt::System::new().block_on(async {
        let db = database.open(args.db.db_pool).await?;
        let store = Store::new(db);
        // One live node per name, held until this process ends (checked
        // once a lease, and taken again after a dropped connection).
        let Some(mut node_name) = store
            .leases().hold_node_id(&config.node_id, config.lease)
            .await
            .context("taking the node's name (ONCEFLOW_NODE_ID)")?
        else {
            anyhow::bail!(
                "another running node uses the name {:?} (ONCEFLOW_NODE_ID): two nodes under one \
                 name would renew and release each other's leases. Give each node its own \
                 ONCEFLOW_NODE_ID, or leave it unset (host:pid)",
                config.node_id
            );
        };
        let loopback = check_tokens(&store, args.listen).await?;
        registry.with_failure_events(args.failure_events);
        let config_guard = config.url_guard.clone();
        let config_secret = config.webhook_secret.clone();
        let engine = Engine::start(store.clone(), registry.clone(), Faults::new(), config);
        match &config_secret {
            Some(secret) => tracing::info!(secrets = secret.len(), "webhooks are signed (Standard Webhooks)"),
            None => tracing::warn!("ONCEFLOW_WEBHOOK_SECRET is unset: webhooks go out UNSIGNED, so consumers cannot tell them from forgeries. Set one or more `whsec_…` secrets"),
        }
        if args.allow_private_urls {
            tracing::warn!("ONCEFLOW_ALLOW_PRIVATE_URLS is set: webhooks and tools may reach loopback, private and link-local addresses (the SSRF guard is off). For local development and tests only");
        }
        let draining = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let state = api_state(
            &args,
            store,
            registry,
            telemetry.clone(),
            config_guard,
            loopback,
            draining.clone(),
            engine.handoff(),
            engine.hub(),
        );
        let server = actix_web::HttpServer::new(move || {
            actix_web::App::new().configure(api::configure(state.clone()))
        })
        .workers(args.http_workers.max(1))
        // Signals are ours: the API keeps answering (503) while the node drains.
        .disable_signals()
        .shutdown_timeout(5)
        .listen(listener)
        .with_context(|| format!("listening on {}", args.listen))?
        .run();
        let http = server.handle();
        let mut serving = actix_web::rt::spawn(server);
        tracing::info!(listen = %args.listen, "onceflow is serving");
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("listening for SIGTERM")?;
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            said = node_name.lost() => {
                engine.shutdown();
                return Err(anyhow::anyhow!(said));
            }
            stopped = &mut serving => {
                engine.shutdown();
                return match stopped {
                    Ok(Ok(())) => Err(anyhow::anyhow!("the HTTP server stopped by itself")),
                    Ok(Err(e)) => Err(anyhow::Error::from(e).context("HTTP server")),
                    Err(e) => Err(anyhow::anyhow!("the HTTP server task failed: {e}")),
                };
            }
        }
        drain(&engine, &draining, args.drain_timeout).await;
        http.stop(true).await;
        let _ = serving.await;
        anyhow::Ok(())
    });
    // Off the runtime: the exporters flush with a blocking client.
    if telemetry.otlp().is_some() {
        match telemetry.shutdown() {
            Ok(()) => tracing::info!("telemetry flushed"),
            Err(e) => tracing::warn!(error = %e, "could not flush telemetry"),
        }
    }
    // A server another process started (a second node on the same data
    // directory) is that process's to stop.
    if let Some(pg) = database.embedded.as_ref().filter(|pg| pg.started_here()) {
        if let Err(e) = pg.stop() {
            tracing::warn!(error = %e, "could not stop the embedded PostgreSQL");
        }
    }
    result
}

pub fn migrate(args: DbArgs) -> anyhow::Result<()> {
    let database = args.resolve()?;
    let result = actix_web::rt::System::new().block_on(async {
        let db = database.open(1).await?;
        drop(db);
        println!("migrations are up to date");
        anyhow::Ok(())
    });
    // Leave a server that was already running (a live `serve`) alone.
    if let Some(pg) = database.embedded.as_ref().filter(|pg| pg.started_here()) {
        let _ = pg.stop();
    }
    result
}

/// The API's tokens as this node starts: off loopback, tokens are required
/// and there must be one to use; on loopback without any, development mode
/// (said loudly); tokens without a signing secret of their own, named.
/// Returns whether the node listens on loopback.
async fn check_tokens(store: &Store, listen: std::net::SocketAddr) -> anyhow::Result<bool> {
    // Off loopback, tokens are required, and there must be one to use.
    let loopback = listen.ip().is_loopback();
    let tokens = store
        .tokens()
        .exist()
        .await
        .context("reading the API tokens")?;
    if !loopback && !tokens {
        anyhow::bail!(
            "refusing to listen on {} without API tokens: anyone who reaches the port could \
             spend your model budget and read every job. Create one first \
             (`onceflow token create --name NAME`, sent as `Authorization: Bearer <token>`), \
             or listen on 127.0.0.1 for development",
            listen
        );
    }
    if loopback && !tokens {
        tracing::warn!(
            listen = %listen,
            "DEVELOPMENT MODE: no API tokens exist, so the API answers anyone on this machine \
             without one. Create a token (`onceflow token create --name NAME`) and every \
             request will need it"
        );
    }
    let unkeyed = store
        .tokens()
        .without_secret()
        .await
        .context("reading the API tokens")?;
    if !unkeyed.is_empty() {
        tracing::warn!(
            tokens = %unkeyed.join(", "),
            "these tokens have no webhook signing secret of their own, so their jobs are \
             signed with ONCEFLOW_WEBHOOK_SECRET, which every tenant's consumer trusts; give \
             each one its own with `onceflow token secret rotate NAME`"
        );
    }
    Ok(loopback)
}

/// The API's state: its bounds from the flags, tokens required (but on
/// loopback while none exist), and new jobs handed to this node's engine.
#[allow(clippy::too_many_arguments)]
fn api_state(
    args: &ServeArgs,
    store: Store,
    registry: onceflow_engine::Registry,
    telemetry: Arc<Telemetry>,
    url_guard: onceflow_engine::UrlGuard,
    loopback: bool,
    draining: Arc<std::sync::atomic::AtomicBool>,
    handoff: onceflow_engine::node::handoff::Handoff,
    hub: Arc<onceflow_engine::hub::Hub>,
) -> ApiState {
    ApiState {
        store,
        registry,
        body_limit: args.body_limit,
        telemetry,
        url_guard,
        hosts: api::Hosts::for_listen(args.listen, &args.allowed_hosts),
        auth: api::Auth::Tokens { loopback },
        limits: {
            let mut limits = api::Bounds::backlog(args.max_backlog, args.max_backlog_per_token);
            limits.max_streams = args.max_streams;
            limits.max_streams_per_token = args.max_streams_per_token;
            // Room for one largest batch at least, whatever was asked.
            let batch = args.body_limit.saturating_mul(16);
            limits.max_body_bytes = args.max_body_bytes_in_flight.max(batch);
            limits.max_body_bytes_per_token = args.max_body_bytes_per_token.max(batch);
            limits.min_schedule_interval = args.min_schedule_interval;
            limits
        },
        draining,
        trace_url: args.trace_url.clone(),
        // A job this node has room for runs here without a queue round trip.
        handoff: Some(handoff),
        hub,
    }
}

/// Drains the node: no new jobs (intake and /healthz answer 503), requests
/// in flight answered and recorded, then the leases handed over.
async fn drain(
    engine: &Engine,
    draining: &std::sync::atomic::AtomicBool,
    timeout: std::time::Duration,
) {
    draining.store(true, std::sync::atomic::Ordering::Release);
    tracing::info!(
        timeout_s = timeout.as_secs_f64(),
        "draining: taking no new work; requests in flight finish and are recorded"
    );
    match engine.drain(timeout).await {
        Ok(released) => tracing::info!(
            released,
            "drained: leases released, other nodes resume those jobs at once"
        ),
        Err(e) => tracing::warn!(error = %e, "could not release the leases; they will expire"),
    }
}
