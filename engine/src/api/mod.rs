//! The HTTP API (actix-web): intake, the job view, health, and `/metrics`
//! (Prometheus text from the node's OpenTelemetry instruments).
//!
//! Requests are authenticated with API tokens ([`Auth`]): a token sees its
//! own jobs (another's is `404`), an admin token all of them. `POST` bodies
//! must be JSON (`415`), the `Host` must be one this server answers
//! (`421`, against DNS rebinding), and a `POST` a browser sent from another
//! site's page is refused (`403`). Event streams are bounded per node and
//! per token (`429`).
//!
//! Errors are `{"error":{"code","message"[,"field"]}}`. No bad request changes
//! stored state: the body is read under a size limit, parsed, validated, and
//! only then offered to the store, whose primary key decides races.
//!
//! This file holds the shared state, the routes and the error shape; the
//! handlers live by concern: `auth` (tokens, `Host`, cross-site),
//! `bounds` (backlog and stream bounds), `jobs` (submit, view, list),
//! `events` (SSE), `operate` (cancel, redrive), `signals`, `console` and
//! `metrics`.
//! They share this module's imports (`use super::*`).

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use onceflow_observability::names::*;
use onceflow_observability::Telemetry;
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
use opentelemetry::KeyValue;

use crate::node::intake;
use crate::rules::traceparent::TraceParent;
use crate::store::{Intake, Store};
use crate::workflow::Registry;

mod auth;
mod batch;
mod bounds;
mod console;
mod error;
mod events;
mod extract;
mod jobs;
mod metrics;
pub mod openapi;
mod operate;
mod schedules;
mod signals;

use auth::*;
pub use auth::{Auth, Hosts};
pub use batch::MAX_BATCH;
use batch::*;
pub use bounds::Bounds;
use console::*;
use error::{ApiError, Code};
use events::*;
use extract::{own_job, Json, OwnJob, Query};
pub use jobs::MAX_PAGE;
use jobs::*;
use metrics::*;
use operate::*;
use schedules::*;
pub use signals::MAX_SIGNAL_PAYLOAD;
use signals::*;
// The types the handlers' OpenAPI attributes name (see `openapi`).
#[allow(unused_imports)]
use crate::store::jobs::JobView;
#[allow(unused_imports)]
use crate::store::schedules::{ScheduleDetail, ScheduleView};
#[allow(unused_imports)]
use crate::store::waits::SignalView;
#[allow(unused_imports)]
use error::ErrorBody;
#[allow(unused_imports)]
use events::SseEvent;

/// Default largest accepted request body (1 MiB).
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct ApiState {
    /// The job store (all SQL).
    pub store: Store,
    /// The registered workflows: a submitted job names one, and its input is validated by it.
    pub registry: Registry,
    /// Largest accepted request body, in bytes (default [`DEFAULT_BODY_LIMIT`]).
    pub body_limit: usize,
    /// The node's telemetry (share the engine's, so `/metrics` shows both).
    pub telemetry: Arc<Telemetry>,
    /// Where a `webhook_url` may point (checked at intake for literal
    /// addresses; names are checked again when the webhook is sent).
    pub url_guard: crate::net::guard::UrlGuard,
    /// The `Host` headers the API answers (DNS-rebinding defence).
    pub hosts: Hosts,
    /// Who may call it.
    pub auth: Auth,
    /// Resource bounds of intake.
    pub limits: Bounds,
    /// Set while the node drains: intake and `/healthz` answer `503`.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// The web console's link to a job's trace: a URL with `{trace_id}`
    /// (e.g. Jaeger's or Tempo's), or `None` for plain text.
    pub trace_url: Option<String>,
    /// This node's engine, when it runs one: a new job it has room for is
    /// handed to it in intake's commit (see [`crate::node::handoff`]).
    pub handoff: Option<crate::node::handoff::Handoff>,
    /// This node's watchers ([`crate::node::runtime::Engine::hub`]): open streams
    /// hear of a job's new events, and of their token's revocation, here.
    /// It must be the hub of the engine that runs beside the API (the
    /// engine feeds it); a hub of its own would leave open streams to their
    /// once-a-minute safety read.
    pub hub: Arc<crate::hub::Hub>,
}

/// Gives the allocator's free pages back to the system after a request
/// that held many bytes (glibc keeps them otherwise: a node that took a
/// few large batches would keep their peak for good).
fn give_memory_back(bytes: usize) {
    if bytes < (1 << 20) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    actix_web::rt::task::spawn_blocking(|| {
        // SAFETY: malloc_trim only returns free memory to the system; it
        // takes the allocator's own locks and touches no live allocation.
        unsafe {
            libc::malloc_trim(0);
        }
    });
}

/// Mounts the API on an actix-web app.
pub fn configure(state: ApiState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(state)).service(
            web::scope("")
                .wrap(actix_web::middleware::from_fn(hygiene))
                .route("/v1/jobs", web::post().to(submit))
                .route("/v1/jobs", web::get().to(list_jobs))
                .route("/v1/stats", web::get().to(stats))
                .route("/v1/jobs/redrive", web::post().to(redrive_bulk))
                .route("/v1/jobs/cancel", web::post().to(cancel_bulk))
                .route("/v1/jobs/batch", web::post().to(submit_batch))
                .route("/v1/jobs/{id}", web::get().to(get_job))
                .route("/v1/jobs/{id}/events", web::get().to(job_events))
                .route("/v1/jobs/{id}/cancel", web::post().to(cancel))
                .route("/v1/jobs/{id}/redrive", web::post().to(redrive))
                .route("/v1/jobs/{id}/rerun", web::post().to(rerun))
                .route("/v1/jobs/{id}/signals/{name}", web::post().to(signal))
                .route("/v1/schedules", web::post().to(create_schedule))
                .route("/v1/schedules", web::get().to(list_schedules))
                .route("/v1/schedules/{id}", web::get().to(get_schedule))
                .route("/v1/schedules/{id}", web::delete().to(delete_schedule))
                .route("/v1/schedules/{id}/pause", web::post().to(pause_schedule))
                .route("/v1/schedules/{id}/resume", web::post().to(resume_schedule))
                .route("/", web::get().to(console_page))
                .route("/console.js", web::get().to(console_js))
                .route("/console.css", web::get().to(console_css))
                .route("/healthz", web::get().to(healthz))
                .route("/metrics", web::get().to(metrics))
                .route("/v1/openapi.json", web::get().to(openapi::openapi_json))
                .default_service(web::to(not_found)),
        );
    }
}

/// Every answer says `X-Content-Type-Options: nosniff`; a path or query
/// holding a NUL character (`%00`, which PostgreSQL cannot store or
/// compare), or a query parameter the OpenAPI document does not give the
/// operation (`POST /v1/jobs/{id}/cancel?dry_run=true` is no dry run), is
/// refused with `422` naming it before any handler runs.
async fn hygiene(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody + 'static>,
) -> Result<actix_web::dev::ServiceResponse<actix_web::body::BoxBody>, actix_web::Error> {
    let uri = req.uri();
    let nul = |part: Option<&str>| part.is_some_and(|p| p.contains("%00"));
    let refused = if nul(Some(uri.path())) {
        Some("path")
    } else if nul(uri.query()) {
        Some("query")
    } else {
        None
    };
    let mut res = match refused {
        Some(field) => {
            let answer = error(
                Code::InvalidRequest,
                format!("the {field} contains a NUL character (%00)"),
                Some(field),
            );
            req.into_response(HttpResponse::from(answer))
        }
        None => match unknown_query_parameter(&req) {
            Some(answer) => req.into_response(HttpResponse::from(answer)),
            None => next.call(req).await?.map_into_boxed_body(),
        },
    };
    res.headers_mut().insert(
        actix_web::http::header::X_CONTENT_TYPE_OPTIONS,
        actix_web::http::header::HeaderValue::from_static("nosniff"),
    );
    Ok(res)
}

/// `422` naming the first query parameter that operation's entry in the
/// OpenAPI document does not list, for every operation it describes; the
/// console's page and assets take none.
fn unknown_query_parameter(req: &actix_web::dev::ServiceRequest) -> Option<ApiError> {
    const NONE: &[String] = &[];
    let query = req.query_string();
    if query.is_empty() {
        return None;
    }
    // The path as the router matches it (`/v1/jobs/%62atch` is the batch).
    let path = percent_encoding::percent_decode_str(req.path()).decode_utf8_lossy();
    let known = match path.as_ref() {
        "/" | "/console.js" | "/console.css" => NONE,
        path => openapi::query_params_of(req.method().as_str(), path)?,
    };
    let pairs = match web::Query::<Vec<(String, String)>>::from_query(query) {
        Ok(pairs) => pairs.into_inner(),
        Err(e) => return Some(bad_query(&e)),
    };
    let (name, _) = pairs.iter().find(|(name, _)| !known.contains(name))?;
    let takes = if known.is_empty() {
        "takes no query parameters".to_owned()
    } else {
        format!("takes only {}", known.join(", "))
    };
    // The name is echoed only when it is short and plain.
    let shown = if name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    {
        name.as_str()
    } else {
        "query"
    };
    Some(error(
        Code::Invalid,
        format!("unknown query parameter {shown:?}: this operation {takes}"),
        Some(shown),
    ))
}

/// A handler's answer: its response, or the error it is refused with.
type Answer = Result<HttpResponse, ApiError>;

/// The error `code` (its status), with `message` and the `field` it is about.
fn error(code: Code, message: impl Into<String>, field: Option<&str>) -> ApiError {
    let e = ApiError::new(code, message);
    match field {
        Some(field) => e.on(field),
        None => e,
    }
}

/// `503 unavailable` for a database error (logged, never sent).
fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(e)
}

/// No route: `405` with `Allow` when the path is one the API serves with
/// other methods (read from the OpenAPI document, which a test keeps equal
/// to the routes), else `404`.
async fn not_found(req: HttpRequest) -> HttpResponse {
    if let Some(allowed) = openapi::methods_of(req.path()) {
        let mut answer: HttpResponse = error(
            Code::MethodNotAllowed,
            format!(
                "{} {} is not served; use {allowed}",
                req.method(),
                req.path()
            ),
            None,
        )
        .into();
        if let Ok(value) = actix_web::http::header::HeaderValue::from_str(&allowed) {
            answer
                .headers_mut()
                .insert(actix_web::http::header::ALLOW, value);
        }
        return answer;
    }
    error(
        Code::NotFound,
        format!("no route for {} {}", req.method(), req.path()),
        None,
    )
    .into()
}

/// A query string that does not parse, or names a parameter the endpoint
/// does not take: `422`, naming the parameter when the parser did.
pub(crate) fn bad_query(e: &actix_web::error::QueryPayloadError) -> ApiError {
    let message = e.to_string();
    let field = message
        .split_once("unknown field `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map_or("query", |(name, _)| name)
        .to_owned();
    error(Code::Invalid, format!("{field}: {message}"), Some(&field))
}
