//! `/healthz` and `/metrics` (Prometheus text from the node's instruments).

use super::*;

/// Open to anyone and any `Host` (load balancers probe by address): it
/// says nothing but whether the database answers.
#[utoipa::path(get, path = "/healthz", tag = "operate", security(()),
    responses((status = 200, description = "The node takes work", body = Health), (status = 503, body = ErrorBody)))]
pub(super) async fn healthz(state: web::Data<ApiState>) -> Answer {
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return Err(error(Code::Draining, "this node is shutting down", None));
    }
    if !state.store.healthy().await.map_err(unavailable)? {
        return Err(error(Code::NotMigrated, "the schema is not migrated", None));
    }
    Ok(HttpResponse::Ok().json(Health { status: "ok" }))
}

/// `/healthz`'s answer when the node takes work.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct Health {
    /// Always `ok`.
    #[schema(pattern = "^ok$")]
    status: &'static str,
}

/// How long a scrape waits for the gauges' read before it answers with
/// the last values.
const GAUGE_READ: std::time::Duration = std::time::Duration::from_secs(2);

#[utoipa::path(get, path = "/metrics", tag = "operate",
    responses((status = 200, description = "Prometheus text", content_type = "text/plain", body = String), (status = 401, body = ErrorBody)))]
pub(super) async fn metrics(_: Reader, state: web::Data<ApiState>) -> HttpResponse {
    // The gauges are read now, as a Prometheus collector reads at scrape
    // time: an idle node issues no statements of its own for them. Bounded:
    // a slow database leaves the last values rather than a hung scrape.
    let _ = tokio::time::timeout(
        GAUGE_READ,
        crate::node::shared::refresh_gauges(&state.store, &state.registry, &state.telemetry),
    )
    .await;
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.telemetry.prometheus())
}
