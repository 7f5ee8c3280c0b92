//! The HTTP API (actix-web): intake, the job view, health, and `/metrics`
//! (Prometheus text from the node's OpenTelemetry instruments).
//!
//! Errors are `{"error":{"code","message"[,"field"]}}`. No bad request changes
//! stored state: the body is read under a size limit, parsed, validated, and
//! only then offered to the store, whose primary key decides races.

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use std::sync::Arc;

use futures_util::StreamExt;
use onceflow_observability::names::*;
use onceflow_observability::Telemetry;
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
use opentelemetry::KeyValue;
use serde_json::json;

use crate::intake::{self, IntakeError};
use crate::store::{Intake, Store};
use crate::trace::TraceParent;
use crate::workflow::Registry;

/// Default largest accepted request body (1 MiB).
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct ApiState {
    pub store: Store,
    pub registry: Registry,
    pub body_limit: usize,
    /// The node's telemetry (share the engine's, so `/metrics` shows both).
    pub telemetry: Arc<Telemetry>,
}

/// Mounts the API on an actix-web app.
pub fn configure(state: ApiState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(state))
            .route("/v1/jobs", web::post().to(submit))
            .route("/v1/jobs/{id}", web::get().to(get_job))
            .route("/healthz", web::get().to(healthz))
            .route("/metrics", web::get().to(metrics))
            .default_service(web::to(not_found));
    }
}

fn error(
    status: StatusCode,
    code: &str,
    message: impl Into<String>,
    field: Option<&str>,
) -> HttpResponse {
    let mut body = json!({ "error": { "code": code, "message": message.into() } });
    if let Some(field) = field {
        body["error"]["field"] = json!(field);
    }
    HttpResponse::build(status).json(body)
}

fn unavailable(e: impl std::fmt::Display) -> HttpResponse {
    tracing::error!(error = %e, "database error");
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        "the database is unavailable; retry the request",
        None,
    )
}

async fn submit(
    state: web::Data<ApiState>,
    req: HttpRequest,
    mut payload: web::Payload,
) -> HttpResponse {
    let limit = state.body_limit;
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the request body exceeds {limit} bytes"),
            None,
        )
    };
    let declared = req
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return too_large();
    }
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let Ok(chunk) = chunk else {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_body",
                "could not read the request body",
                None,
            );
        };
        if body.len() + chunk.len() > limit {
            return too_large();
        }
        body.extend_from_slice(&chunk);
    }
    let job = match intake::parse(&body, &state.registry) {
        Ok(job) => job,
        Err(IntakeError::Malformed(m)) => {
            return error(StatusCode::BAD_REQUEST, "malformed_json", m, None)
        }
        Err(IntakeError::Invalid(e)) => {
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid",
                e.to_string(),
                Some(&e.field),
            )
        }
    };
    // The `submit` span continues the caller's trace when it sent one; its
    // context is stored with the job, so every attempt is its child.
    let caller = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let parent = caller
        .as_ref()
        .map(crate::observe::remote_context)
        .unwrap_or_default();
    let tracer = state.telemetry.tracer();
    let mut span = tracer
        .span_builder(SPAN_SUBMIT)
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new(JOB_ID, job.id.clone()),
            KeyValue::new(WORKFLOW_NAME, job.workflow.clone()),
        ])
        .start_with_context(tracer, &parent);
    let trace = crate::observe::trace_parent(span.span_context())
        .or(caller)
        .unwrap_or_else(TraceParent::new_root);
    let submitted = |outcome: &'static str| {
        state.telemetry.metrics().jobs_submitted.add(
            1,
            &[
                KeyValue::new(WORKFLOW_NAME, job.workflow.clone()),
                KeyValue::new(SUBMIT_OUTCOME, outcome),
            ],
        );
    };
    let result = state.store.submit_traced(&job, trace).await;
    let outcome = match &result {
        Ok(Intake::Created(_)) => "created",
        Ok(Intake::Existing(_)) => "existing",
        Ok(Intake::Conflict(_)) => "conflict",
        Err(_) => "unavailable",
    };
    span.set_attribute(KeyValue::new(SUBMIT_OUTCOME, outcome));
    if result.is_err() {
        span.set_status(Status::error(outcome));
    }
    span.end();
    match result {
        Ok(Intake::Created(view)) => {
            submitted("created");
            HttpResponse::Created().json(view)
        }
        Ok(Intake::Existing(view)) => {
            submitted("existing");
            HttpResponse::Ok().json(view)
        }
        Ok(Intake::Conflict(_)) => error(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "job {:?} already exists with a different request; the stored job is unchanged",
                job.id
            ),
            Some("id"),
        ),
        Err(e) => unavailable(e),
    }
}

async fn get_job(state: web::Data<ApiState>, id: web::Path<String>) -> HttpResponse {
    match state.store.job(&id).await {
        Ok(Some(view)) => HttpResponse::Ok().json(view),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {:?}", id.as_str()),
            None,
        ),
        Err(e) => unavailable(e),
    }
}

async fn healthz(state: web::Data<ApiState>) -> HttpResponse {
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

async fn metrics(state: web::Data<ApiState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.telemetry.prometheus())
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {} {}", req.method(), req.path()),
        None,
    )
}
