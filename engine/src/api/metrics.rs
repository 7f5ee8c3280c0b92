//! `/healthz` and `/metrics` (Prometheus text from the node's instruments).

use super::*;

/// Open to anyone and any `Host` (load balancers probe by address): it
/// says nothing but whether the database answers.
#[utoipa::path(get, path = "/healthz", tag = "operate", security(()),
    responses((status = 200, description = "`{\"status\": \"ok\"}`"), (status = 503, body = ErrorBody)))]
pub(super) async fn healthz(state: web::Data<ApiState>) -> HttpResponse {
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "this node is shutting down",
            None,
        );
    }
    match state.store.healthy().await {
        Ok(true) => HttpResponse::Ok().json(json!({ "status": "ok" })),
        Ok(false) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_migrated",
            "the schema is not migrated",
            None,
        ),
        Err(e) => unavailable(e),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "operate",
    responses((status = 200, description = "Prometheus text", content_type = "text/plain", body = String), (status = 401, body = ErrorBody)))]
pub(super) async fn metrics(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    if let Err(refused) = authenticate(&state, &req).await {
        return refused;
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.telemetry.prometheus())
}
