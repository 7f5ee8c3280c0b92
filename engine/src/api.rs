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

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use onceflow_observability::names::*;
use onceflow_observability::Telemetry;
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
use opentelemetry::KeyValue;
use serde_json::json;

use crate::intake::{self, IntakeError};
use crate::store::{Intake, Store};
use crate::traceparent::TraceParent;
use crate::workflow::Registry;

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
    pub url_guard: crate::guard::UrlGuard,
    /// The `Host` headers the API answers (DNS-rebinding defence).
    pub hosts: Hosts,
    /// Who may call it.
    pub auth: Auth,
    /// Resource bounds of intake.
    pub limits: Limits,
    /// Set while the node drains: intake and `/healthz` answer `503`.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// The web console's link to a job's trace: a URL with `{trace_id}`
    /// (e.g. Jaeger's or Tempo's), or `None` for plain text.
    pub trace_url: Option<String>,
    /// This node's engine, when it runs one: a new job it has room for is
    /// handed to it in intake's commit (see [`crate::handoff`]).
    pub handoff: Option<crate::handoff::Handoff>,
}

/// Per token (`None`: no token): when the backlog was read, in total and its own.
type BacklogSeen = std::collections::HashMap<Option<i64>, (std::time::Instant, u64, u64)>;

/// Resource bounds of intake.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A request body must arrive within this long (a client dribbling it,
    /// slowloris-style, gets `408`).
    pub body_timeout: std::time::Duration,
    /// Unfinished jobs in the database above which new jobs are refused
    /// with `429` and `Retry-After`.
    pub max_backlog: u64,
    /// The same bound per API token.
    pub max_backlog_per_token: u64,
    /// The last counts read, with when (refreshed at most once a second).
    seen: Arc<std::sync::Mutex<BacklogSeen>>,
    /// Event streams (`GET /v1/jobs/{id}/events`) open at once on this
    /// node; one more is `429`. Each reads the journal about every 250 ms
    /// until its job ends, on the pool the engine writes through.
    pub max_streams: usize,
    /// The same bound per API token.
    pub max_streams_per_token: usize,
    /// The event streams open now: in all, and per token.
    streams: Arc<std::sync::Mutex<OpenStreams>>,
}

#[derive(Debug, Default)]
struct OpenStreams {
    total: usize,
    per_token: std::collections::HashMap<i64, usize>,
}

/// An open event stream's place under [`Limits::max_streams`], given back
/// when the stream ends.
struct StreamSlot {
    streams: Arc<std::sync::Mutex<OpenStreams>>,
    token: Option<i64>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.lock().expect("streams lock");
        open.total -= 1;
        if let Some(token) = self.token {
            if let Some(n) = open.per_token.get_mut(&token) {
                *n -= 1;
                if *n == 0 {
                    open.per_token.remove(&token);
                }
            }
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            body_timeout: std::time::Duration::from_secs(30),
            max_backlog: 100_000,
            max_backlog_per_token: 10_000,
            seen: Default::default(),
            max_streams: 1_000,
            max_streams_per_token: 100,
            streams: Default::default(),
        }
    }
}

impl Limits {
    /// These bounds, with the default body timeout.
    pub fn backlog(max_backlog: u64, max_backlog_per_token: u64) -> Self {
        Limits {
            max_backlog,
            max_backlog_per_token,
            ..Limits::default()
        }
    }

    /// A place for one more event stream of `token`, or why not.
    fn open_stream(&self, token: Option<i64>) -> Result<StreamSlot, String> {
        let mut open = self.streams.lock().expect("streams lock");
        if open.total >= self.max_streams {
            return Err(format!(
                "{} event streams are open on this node; the limit is {}",
                open.total, self.max_streams
            ));
        }
        if let Some(token) = token {
            let mine = open.per_token.entry(token).or_insert(0);
            if *mine >= self.max_streams_per_token {
                return Err(format!(
                    "this token has {mine} event streams open; the limit is {}",
                    self.max_streams_per_token
                ));
            }
            *mine += 1;
        }
        open.total += 1;
        Ok(StreamSlot {
            streams: self.streams.clone(),
            token,
        })
    }

    /// The backlog (in total, and of `owner`), at most a second old: one
    /// indexed count per second per token, not one per request.
    async fn counts(
        &self,
        store: &Store,
        owner: Option<i64>,
    ) -> Result<(u64, u64), crate::error::StoreError> {
        let fresh = self
            .seen
            .lock()
            .expect("limits lock")
            .get(&owner)
            .filter(|(at, _, _)| at.elapsed() < std::time::Duration::from_secs(1))
            .map(|(_, total, mine)| (*total, *mine));
        if let Some(counts) = fresh {
            return Ok(counts);
        }
        let (total, mine) = store.backlog(owner).await?;
        self.seen
            .lock()
            .expect("limits lock")
            .insert(owner, (std::time::Instant::now(), total, mine));
        Ok((total, mine))
    }
}

/// How requests are authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// Nobody is asked (an in-process API in tests and `bench`): every
    /// request sees every job.
    Off,
    /// API tokens (`Authorization: Bearer …`). With `loopback` (the server
    /// listens on a loopback address) and no live token at all, requests
    /// need none: development mode, announced at start-up. Off loopback, or
    /// once any token exists, every request needs a live one (`401`).
    /// Revoking the last token never reopens a non-loopback server.
    Tokens {
        /// The server listens on a loopback address.
        loopback: bool,
    },
}

/// Who a request acts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    /// No authentication applies: sees every job; submits jobs with no owner.
    Anyone,
    /// A token: sees its own jobs, or all of them when admin.
    Token(crate::store::tokens::Caller),
}

impl Who {
    fn owner(self) -> Option<i64> {
        match self {
            Who::Anyone => None,
            Who::Token(c) => Some(c.token),
        }
    }

    /// The owner filter of a listing: `None` (all jobs) unless a plain token.
    fn scope(self) -> Option<i64> {
        match self {
            Who::Anyone => None,
            Who::Token(c) if c.admin => None,
            Who::Token(c) => Some(c.token),
        }
    }

    fn sees(self, owner: Option<i64>) -> bool {
        match self {
            Who::Anyone => true,
            Who::Token(c) => c.admin || owner == Some(c.token),
        }
    }
}

fn unauthorized(message: &str) -> HttpResponse {
    let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized", message, None);
    r.headers_mut().insert(
        actix_web::http::header::WWW_AUTHENTICATE,
        actix_web::http::header::HeaderValue::from_static("Bearer"),
    );
    r
}

/// Checks the request's token (never taken from the URL).
async fn authenticate(state: &ApiState, req: &HttpRequest) -> Result<Who, HttpResponse> {
    let loopback = match state.auth {
        Auth::Off => return Ok(Who::Anyone),
        Auth::Tokens { loopback } => loopback,
    };
    match req.headers().get(actix_web::http::header::AUTHORIZATION) {
        Some(value) => {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
                .filter(|t| !t.is_empty());
            let Some(token) = token else {
                return Err(unauthorized(
                    "the Authorization header must be `Bearer <token>`",
                ));
            };
            match state.store.authenticate(token).await {
                Ok(Some(caller)) => Ok(Who::Token(caller)),
                Ok(None) => Err(unauthorized("the token is unknown or revoked")),
                Err(e) => Err(unavailable(e)),
            }
        }
        None if !loopback => Err(unauthorized(
            "an API token is required: send `Authorization: Bearer <token>` \
             (create one with `onceflow token create --name NAME`)",
        )),
        // A reverse proxy in front of a loopback node would open development
        // mode to the world: a proxied request needs a token.
        None if ["forwarded", "x-forwarded-for", "x-real-ip"]
            .iter()
            .any(|h| req.headers().contains_key(*h)) =>
        {
            Err(unauthorized(
                "this request came through a proxy: development mode (no tokens) answers only \
                 direct loopback requests; create a token with `onceflow token create --name NAME`",
            ))
        }
        None => match state.store.tokens_exist().await {
            Ok(false) => Ok(Who::Anyone),
            Ok(true) => Err(unauthorized(
                "an API token is required: send `Authorization: Bearer <token>`",
            )),
            Err(e) => Err(unavailable(e)),
        },
    }
}

/// Which `Host` header values the API answers; anything else is `421`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hosts {
    /// Any (an in-process API in tests).
    Any,
    /// Exactly these `host[:port]` values (lower case).
    Only(Vec<String>),
}

impl Hosts {
    /// The listen address itself, `localhost:<port>` when it is loopback,
    /// and every name in `extra` (`ONCEFLOW_ALLOWED_HOSTS`, with or
    /// without a port).
    pub fn for_listen(listen: std::net::SocketAddr, extra: &[String]) -> Hosts {
        let port = listen.port();
        let mut hosts = vec![listen.to_string()];
        if listen.ip().is_loopback() {
            hosts.push(format!("localhost:{port}"));
            if listen.is_ipv4() {
                hosts.push(format!("[::1]:{port}"));
            } else {
                hosts.push(format!("127.0.0.1:{port}"));
            }
        }
        for name in extra {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() {
                continue;
            }
            let has_port = if name.starts_with('[') {
                name.contains("]:")
            } else {
                name.contains(':')
            };
            if has_port {
                hosts.push(name);
            } else {
                hosts.push(format!("{name}:{port}"));
                hosts.push(name);
            }
        }
        Hosts::Only(hosts)
    }

    fn allows(&self, host: Option<&str>) -> bool {
        match self {
            Hosts::Any => true,
            Hosts::Only(list) => host.is_some_and(|h| {
                let h = h.to_ascii_lowercase();
                list.contains(&h)
            }),
        }
    }
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
                .route("/v1/jobs/{id}", web::get().to(get_job))
                .route("/v1/jobs/{id}/events", web::get().to(job_events))
                .route("/v1/jobs/{id}/cancel", web::post().to(cancel))
                .route("/v1/jobs/{id}/redrive", web::post().to(redrive))
                .route("/", web::get().to(console_page))
                .route("/console.js", web::get().to(console_js))
                .route("/console.css", web::get().to(console_css))
                .route("/healthz", web::get().to(healthz))
                .route("/metrics", web::get().to(metrics))
                .default_service(web::to(not_found)),
        );
    }
}

/// Every answer says `X-Content-Type-Options: nosniff`; a path or query
/// holding a NUL character (`%00`, which PostgreSQL cannot store or
/// compare) is refused with `422` before any handler runs.
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
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                format!("the {field} contains a NUL character (%00)"),
                Some(field),
            );
            req.into_response(answer)
        }
        None => next.call(req).await?.map_into_boxed_body(),
    };
    res.headers_mut().insert(
        actix_web::http::header::X_CONTENT_TYPE_OPTIONS,
        actix_web::http::header::HeaderValue::from_static("nosniff"),
    );
    Ok(res)
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

/// `421` unless the request's `Host` is one this API answers.
fn misdirected(state: &ApiState, req: &HttpRequest) -> Option<HttpResponse> {
    let host = req
        .headers()
        .get(actix_web::http::header::HOST)
        .and_then(|v| v.to_str().ok());
    (!state.hosts.allows(host)).then(|| {
        error(
            StatusCode::MISDIRECTED_REQUEST,
            "misdirected",
            "this server does not answer for that Host; add the name to ONCEFLOW_ALLOWED_HOSTS",
            None,
        )
    })
}

/// `403` for a browser's request sent by another site's page. Such a page
/// may send a `POST` that needs no preflight (a form, or a body-less
/// `no-cors` fetch) with the right `Host`, and on loopback with no tokens
/// nothing else would stop it from cancelling or redriving jobs. Browsers
/// name the page's origin on every such request (`Origin`, and
/// `Sec-Fetch-Site`); it must be the server itself: the request's own
/// `Host`, or a name the API answers. Clients that are not browsers send
/// neither header and pass.
fn cross_site(state: &ApiState, req: &HttpRequest) -> Option<HttpResponse> {
    let headers = req.headers();
    let same = match headers.get(actix_web::http::header::ORIGIN) {
        Some(origin) => {
            let host = headers
                .get(actix_web::http::header::HOST)
                .and_then(|v| v.to_str().ok());
            origin
                .to_str()
                .ok()
                .and_then(origin_authority)
                .is_some_and(|authority| {
                    host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
                        || matches!(&state.hosts, Hosts::Only(list)
                            if list.contains(&authority.to_ascii_lowercase()))
                })
        }
        // Without `Origin`, trust only a browser that says the request is
        // its own page's (or typed by the user).
        None => headers
            .get("sec-fetch-site")
            .and_then(|v| v.to_str().ok())
            .is_none_or(|site| site == "same-origin" || site == "none"),
    };
    (!same).then(|| {
        error(
            StatusCode::FORBIDDEN,
            "cross_site",
            "a page of another site may not call this API; \
             call it from the console or a client that is not a browser",
            None,
        )
    })
}

/// `408`: a request body (intake's or an action's) did not arrive within
/// [`Limits::body_timeout`].
fn body_timed_out(limits: &Limits) -> HttpResponse {
    error(
        StatusCode::REQUEST_TIMEOUT,
        "body_timeout",
        format!(
            "the request body did not arrive within {} s",
            limits.body_timeout.as_secs_f64()
        ),
        None,
    )
}

/// `host[:port]` of an `Origin` value (`scheme://host[:port]`); `None` for
/// `null` and anything else.
fn origin_authority(origin: &str) -> Option<&str> {
    let (scheme, authority) = origin.split_once("://")?;
    let plain = |s: &str| !s.is_empty() && !s.contains(['/', '?', '#', '@', ' ']);
    (plain(scheme) && plain(authority)).then_some(authority)
}

async fn submit(
    state: web::Data<ApiState>,
    req: HttpRequest,
    mut payload: web::Payload,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req).or_else(|| cross_site(&state, &req)) {
        return refused;
    }
    // A form or text/plain POST is what a web page can send cross-site
    // without a preflight: JSON only.
    let json = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "this node is shutting down and takes no new jobs; retry (another node, or this one restarted)",
            None,
        );
        r.headers_mut().insert(
            actix_web::http::header::RETRY_AFTER,
            actix_web::http::header::HeaderValue::from_static("2"),
        );
        return r;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    if !json {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with Content-Type: application/json",
            None,
        );
    }
    // Refuse before reading the body when the backlog is full.
    match state.limits.counts(&state.store, who.owner()).await {
        Ok((total, mine)) => {
            let over = if total >= state.limits.max_backlog {
                Some(format!(
                    "{total} unfinished jobs; the limit is {}",
                    state.limits.max_backlog
                ))
            } else if who.owner().is_some() && mine >= state.limits.max_backlog_per_token {
                Some(format!(
                    "this token has {mine} unfinished jobs; the limit is {}",
                    state.limits.max_backlog_per_token
                ))
            } else {
                None
            };
            if let Some(message) = over {
                let mut r = error(StatusCode::TOO_MANY_REQUESTS, "backlog_full", message, None);
                r.headers_mut().insert(
                    actix_web::http::header::RETRY_AFTER,
                    actix_web::http::header::HeaderValue::from_static("5"),
                );
                return r;
            }
        }
        Err(e) => return unavailable(e),
    }
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
    let read = async {
        while let Some(chunk) = payload.next().await {
            let Ok(chunk) = chunk else {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    "could not read the request body",
                    None,
                ));
            };
            if body.len() + chunk.len() > limit {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match actix_web::rt::time::timeout(state.limits.body_timeout, read).await {
        Ok(Ok(())) => {}
        Ok(Err(refused)) => return refused,
        Err(_) => return body_timed_out(&state.limits),
    }
    let job = match intake::parse(&body, &state.registry, &state.url_guard) {
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
    if matches!(who, Who::Token(c) if !c.admin)
        && job.schedule.priority.abs() > intake::MAX_TENANT_PRIORITY
    {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
            format!(
                "priority: must be from -{m} to {m} for a token that is not admin",
                m = intake::MAX_TENANT_PRIORITY
            ),
            Some("priority"),
        );
    }
    // The `submit` span continues the caller's trace when it sent one; its
    // context is stored with the job, so every attempt is its child.
    let caller = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let parent = caller
        .as_ref()
        .map(crate::attempt_spans::remote_context)
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
    let trace = crate::attempt_spans::trace_parent(span.span_context())
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
    let notify = state.registry.failure_events(&job.workflow);
    let reservation = state
        .handoff
        .as_ref()
        .and_then(|h| h.reserve(&job.workflow, job.workflow_version));
    // On a task of its own: a caller that goes away while the batch commits
    // must not strand a handed-off job (committed leased, never adopted).
    let submitting = {
        let (store, job, owner) = (state.store.clone(), job.clone(), who.owner());
        actix_web::rt::spawn(async move {
            let hand_to = reservation.as_ref().map(|r| r.hand_to());
            let (intake, leased) = store
                .submit_handed(&job, trace, owner, notify, hand_to)
                .await?;
            if let (Some(reservation), Some(leased)) = (reservation, leased) {
                reservation.adopt(leased);
            }
            Ok(intake)
        })
    };
    let result = submitting.await.unwrap_or_else(|e| {
        Err(crate::error::StoreError::Batch(format!(
            "the submission's task failed: {e}"
        )))
    });
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
        // Another token's job: the id is taken, and nothing more is said.
        Ok(Intake::Existing(view)) | Ok(Intake::Conflict(view)) if !who.sees(view.owner_token) => {
            error(
                StatusCode::CONFLICT,
                "conflict",
                format!("job id {:?} is not available", job.id),
                Some("id"),
            )
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

async fn get_job(
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    match state.store.job(&id).await {
        // Another token's job is as absent as a job that never was.
        Ok(Some(view)) if who.sees(view.owner_token) => HttpResponse::Ok().json(view),
        Ok(_) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {:?}", id.as_str()),
            None,
        ),
        Err(e) => unavailable(e),
    }
}

/// `GET /v1/jobs/{id}/events`: the job's events as server-sent events —
/// the chunks of its streamed answers (`chunk`), a restarted stream's
/// `reset`, and its state changes (`state`) — each with the `id` of one
/// increasing sequence per job. Only journaled (durable) events are sent,
/// so what a watcher saw is always a prefix of the journal. `Last-Event-ID`
/// resumes after that event; the stream ends after the job's final state.
async fn job_events(
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    let after = match req.headers().get("last-event-id") {
        None => 0,
        Some(v) => match v.to_str().ok().and_then(|v| v.trim().parse::<i64>().ok()) {
            Some(n) if n >= 0 => n,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_header",
                    "Last-Event-ID must be the id of an event this stream sent (a non-negative integer)",
                    Some("Last-Event-ID"),
                )
            }
        },
    };
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    let slot = match state.limits.open_stream(who.owner()) {
        Ok(slot) => slot,
        Err(message) => {
            let mut r = error(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_streams",
                message,
                None,
            );
            r.headers_mut().insert(
                actix_web::http::header::RETRY_AFTER,
                actix_web::http::header::HeaderValue::from_static("5"),
            );
            return r;
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<web::Bytes>(64);
    let (store, id) = (state.store.clone(), id.into_inner());
    let token = who.owner();
    actix_web::rt::spawn(async move {
        let _slot = slot; // held until the stream ends
                          // Transitions of a followed job are announced (NOTIFY) by the
                          // database; without the row the stream still works, polling.
        let followed = match store.follow(&id).await {
            Ok(row) => Some(row),
            Err(e) => {
                tracing::warn!(error = %e, job.id = id, "cannot record a stream; it polls instead");
                None
            }
        };
        follow_events(store.clone(), id, after, token, followed.is_some(), tx).await;
        if let Some(row) = followed {
            if let Err(e) = store.unfollow(row).await {
                tracing::warn!(error = %e, "cannot remove a closed stream's row; the purge will");
            }
        }
    });
    let body = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|b| b.map(Ok::<_, actix_web::Error>))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body)
}

/// Sends `job_id`'s events after `after` to `tx` as they are journaled,
/// until the job's final state has been sent, the watcher leaves, or its
/// token is revoked. Chunks written on this node arrive as committed and
/// are sent without reading them back when they follow the last event
/// sent; anything else (another node's chunks, state changes, a gap) is
/// read from the journal when a `NOTIFY` says the job moved. An idle stream
/// reads nothing: it sends a keep-alive comment every 15 s and reads again
/// once a minute as a safety net (a `NOTIFY` lost while the node's `LISTEN`
/// reconnected), checking its token then. Without the `followed` row
/// (`Store::follow` failed) it reads every second.
async fn follow_events(
    store: Store,
    job_id: String,
    mut after: i64,
    token: Option<i64>,
    followed: bool,
    tx: tokio::sync::mpsc::Sender<web::Bytes>,
) {
    use tokio::sync::broadcast::error::RecvError;
    const KEEP_ALIVE: Duration = Duration::from_secs(15);
    let safety = if followed {
        Duration::from_secs(60)
    } else {
        Duration::from_secs(1)
    };
    let frame = |event: &crate::store::streams::JobEvent| {
        let data = serde_json::to_string(event).expect("an event serialises");
        web::Bytes::from(format!(
            "id: {}\nevent: {}\ndata: {data}\n\n",
            event.id, event.kind
        ))
    };
    // Subscribed before the first read, so a commit in between is not missed.
    let mut moved = store.watch_stream(&job_id);
    loop {
        let events = match store.job_events(&job_id, after, 500).await {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(error = %e, job.id = job_id, "reading a job's events");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut finished = false;
        for event in &events {
            after = event.id;
            finished = event.kind == "state"
                && event
                    .text
                    .parse::<crate::JobState>()
                    .is_ok_and(|s| s.is_terminal());
            if tx.send(frame(event)).await.is_err() {
                return; // the watcher left
            }
        }
        if finished {
            return;
        }
        if events.len() == 500 {
            continue; // more to read
        }
        if events.is_empty() {
            // Resumed past the end of a finished job: nothing more will come.
            if let Ok(Some(view)) = store.job(&job_id).await {
                if view.state.is_terminal() {
                    return;
                }
            }
        }
        // Chunks come as they commit, other moves as announced.
        let read_at = std::time::Instant::now();
        loop {
            let wait = KEEP_ALIVE.min(safety.saturating_sub(read_at.elapsed()));
            tokio::select! {
                published = moved.recv() => match published {
                    Ok(p) if p.prev == Some(after) && !p.events.is_empty() => {
                        for event in &p.events {
                            after = event.id;
                            if tx.send(frame(event)).await.is_err() {
                                return;
                            }
                        }
                    }
                    // Announced, and seen already (this node's own write).
                    Ok(p) if p.upto.is_some_and(|upto| upto <= after) => {}
                    Ok(_) | Err(RecvError::Lagged(_)) => break,
                    Err(RecvError::Closed) => {
                        moved = store.watch_stream(&job_id);
                        break;
                    }
                },
                _ = tokio::time::sleep(wait) => {
                    if read_at.elapsed() >= safety {
                        // A revoked token's stream ends.
                        if let Some(token) = token {
                            if matches!(store.token_live(token).await, Ok(false)) {
                                return;
                            }
                        }
                        break;
                    }
                    if tx
                        .send(web::Bytes::from_static(b": keep-alive\n\n"))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        }
    }
}

/// The body of an operator's action: why.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionBody {
    reason: Option<String>,
    /// Bulk redrive: only this workflow's dead jobs.
    workflow: Option<String>,
    /// Bulk redrive: at most this many (default and most 1,000).
    limit: Option<i64>,
}

/// Reads an action's optional JSON body (at most 16 KiB, within the
/// intake's body timeout, so a dribbled body cannot hold a connection).
async fn action_body(
    state: &ApiState,
    req: &HttpRequest,
    mut payload: web::Payload,
) -> Result<ActionBody, HttpResponse> {
    let mut body = web::BytesMut::new();
    let read = async {
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|_| {
                error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    "could not read the request body",
                    None,
                )
            })?;
            if body.len() + chunk.len() > 16 * 1024 {
                return Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    "an action's body is at most 16 KiB",
                    None,
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match actix_web::rt::time::timeout(state.limits.body_timeout, read).await {
        Ok(read) => read?,
        Err(_) => return Err(body_timed_out(&state.limits)),
    }
    if body.is_empty() {
        return Ok(ActionBody::default());
    }
    let json = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with Content-Type: application/json",
            None,
        ));
    }
    let parsed: ActionBody = serde_json::from_slice(&body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "malformed_json",
            e.to_string(),
            None,
        )
    })?;
    for (field, text) in [("reason", &parsed.reason), ("workflow", &parsed.workflow)] {
        if text.as_deref().is_some_and(|t| t.contains('\0')) {
            return Err(error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request",
                format!("{field} contains a NUL character"),
                Some(field),
            ));
        }
    }
    Ok(parsed)
}

/// How a caller is named in history rows.
async fn caller_name(state: &ApiState, who: Who) -> String {
    match who {
        Who::Anyone => "api".to_owned(),
        Who::Token(c) => match state.store.token_name(c.token).await {
            Ok(Some(name)) => format!("token:{name}"),
            _ => format!("token#{}", c.token),
        },
    }
}

/// The job `id` if `who` may act on it, else the answer to give.
async fn own_job(
    state: &ApiState,
    who: Who,
    id: &str,
) -> Result<crate::store::JobView, HttpResponse> {
    match state.store.job(id).await {
        Ok(Some(view)) if who.sees(view.owner_token) => Ok(view),
        Ok(_) => Err(error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {id:?}"),
            None,
        )),
        Err(e) => Err(unavailable(e)),
    }
}

/// `POST /v1/jobs/{id}/cancel` `{"reason"}`: `202` and the job once it is
/// `cancelled` (also when it already was); `409` when it finished first.
async fn cancel(
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
    payload: web::Payload,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req).or_else(|| cross_site(&state, &req)) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    let body = match action_body(&state, &req, payload).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Cancelled;
    let cancelled = state.store.cancel(&id, &by, &reason).await;
    if let Ok(Cancelled::Now) = cancelled {
        state
            .telemetry
            .metrics()
            .transition(crate::lifecycle::JobState::Cancelled.as_str());
    }
    match cancelled {
        Ok(Cancelled::Now | Cancelled::Already) => match state.store.job(&id).await {
            Ok(Some(view)) => HttpResponse::Accepted().json(view),
            Ok(None) => error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no job {:?}", id.as_str()),
                None,
            ),
            Err(e) => unavailable(e),
        },
        Ok(Cancelled::Finished(s)) => error(
            StatusCode::CONFLICT,
            "finished",
            format!(
                "job {:?} already finished as {s}; only a live job can be cancelled",
                id.as_str()
            ),
            None,
        ),
        Ok(Cancelled::Missing) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {:?}", id.as_str()),
            None,
        ),
        Err(e) => unavailable(e),
    }
}

#[derive(Debug, serde::Deserialize)]
struct RedriveQuery {
    confirm_unknown: Option<bool>,
}

/// `POST /v1/jobs/{id}/redrive` `{"reason"}`: `202` and the job resumed at
/// its last live state, with the same keys; `409` when it is not dead, or
/// when its webhook's outcome is unknown and `?confirm_unknown=true` is absent.
async fn redrive(
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
    payload: web::Payload,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req).or_else(|| cross_site(&state, &req)) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    let confirm = match web::Query::<RedriveQuery>::from_query(req.query_string()) {
        Ok(q) => q.confirm_unknown.unwrap_or(false),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_query",
                e.to_string(),
                Some("confirm_unknown"),
            )
        }
    };
    let body = match action_body(&state, &req, payload).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Redriven;
    match state.store.redrive(&id, &by, &reason, confirm).await {
        Ok(Redriven::Resumed(_)) => match state.store.job(&id).await {
            Ok(Some(view)) => HttpResponse::Accepted().json(view),
            Ok(None) => error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no job {:?}", id.as_str()),
                None,
            ),
            Err(e) => unavailable(e),
        },
        Ok(Redriven::NotDead(s)) => error(
            StatusCode::CONFLICT,
            "not_dead",
            format!(
                "job {:?} is {s}; only a dead job can be redriven",
                id.as_str()
            ),
            None,
        ),
        Ok(Redriven::UnknownDelivery) => error(
            StatusCode::CONFLICT,
            "delivery_unknown",
            "its webhook may have reached the consumer (at-most-once, outcome unknown); \
             redrive with ?confirm_unknown=true to send it again under the same webhook-id",
            None,
        ),
        Ok(Redriven::Missing) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {:?}", id.as_str()),
            None,
        ),
        Err(e) => unavailable(e),
    }
}

/// `POST /v1/jobs/redrive` `{"reason", "workflow"?, "limit"?}`: redrives the
/// caller's dead jobs (an admin token: everyone's), oldest death first,
/// skipping those whose delivery is unknown unless `?confirm_unknown=true`;
/// answers `{"redriven": n, "skipped_unknown": m}`.
async fn redrive_bulk(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req).or_else(|| cross_site(&state, &req)) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    let confirm = match web::Query::<RedriveQuery>::from_query(req.query_string()) {
        Ok(q) => q.confirm_unknown.unwrap_or(false),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_query",
                e.to_string(),
                Some("confirm_unknown"),
            )
        }
    };
    let body = match action_body(&state, &req, payload).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let limit = body.limit.unwrap_or(1000);
    if !(1..=1000).contains(&limit) {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
            "must be from 1 to 1000",
            Some("limit"),
        );
    }
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "bulk redrive".into());
    let ids = match state
        .store
        .dead_ids(body.workflow.as_deref(), who.scope(), limit)
        .await
    {
        Ok(ids) => ids,
        Err(e) => return unavailable(e),
    };
    let (mut redriven, mut skipped) = (0u64, 0u64);
    for id in ids {
        use crate::store::operate::Redriven;
        match state.store.redrive(&id, &by, &reason, confirm).await {
            Ok(Redriven::Resumed(_)) => redriven += 1,
            Ok(Redriven::UnknownDelivery) => skipped += 1,
            Ok(Redriven::NotDead(_) | Redriven::Missing) => {}
            Err(e) => return unavailable(e),
        }
    }
    HttpResponse::Accepted().json(json!({ "redriven": redriven, "skipped_unknown": skipped }))
}

/// The query of `GET /v1/jobs`.
#[derive(Debug, serde::Deserialize)]
struct ListQuery {
    state: Option<String>,
    workflow: Option<String>,
    since: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

/// Largest page of `GET /v1/jobs`.
pub const MAX_PAGE: i64 = 500;

/// A keyset cursor: the last row of a page, as `created_at` (µs) and id,
/// URL-safe base64. Opaque to clients.
fn encode_cursor(at: chrono::DateTime<chrono::Utc>, id: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(format!("{}|{id}", at.timestamp_micros()))
}

fn decode_cursor(cursor: &str) -> Option<(chrono::DateTime<chrono::Utc>, String)> {
    use base64::Engine as _;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (micros, id) = text.split_once('|')?;
    let at = chrono::DateTime::from_timestamp_micros(micros.parse().ok()?)?;
    crate::intake::validate_id(id).ok()?;
    Some((at, id.to_owned()))
}

/// `GET /v1/jobs?state=&workflow=&since=&limit=&cursor=`: newest first,
/// keyset-paginated; a token sees its own jobs, an admin token all.
async fn list_jobs(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    let query = match web::Query::<ListQuery>::from_query(req.query_string()) {
        Ok(q) => q.into_inner(),
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_query", e.to_string(), None),
    };
    let invalid = |field: &str, message: String| {
        error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
            message,
            Some(field),
        )
    };
    let job_state = match query
        .state
        .as_deref()
        .map(str::parse::<crate::lifecycle::JobState>)
    {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => {
            let names: Vec<&str> = crate::lifecycle::JobState::ALL
                .iter()
                .map(|s| s.as_str())
                .collect();
            return invalid("state", format!("must be one of {}", names.join(", ")));
        }
    };
    let since = match query
        .since
        .as_deref()
        .map(chrono::DateTime::parse_from_rfc3339)
    {
        None => None,
        Some(Ok(t)) => Some(t.with_timezone(&chrono::Utc)),
        Some(Err(e)) => return invalid("since", format!("must be an RFC 3339 time: {e}")),
    };
    let limit = match query.limit.as_deref().map(str::parse::<i64>) {
        None => 50,
        Some(Ok(n)) if (1..=MAX_PAGE).contains(&n) => n,
        Some(_) => return invalid("limit", format!("must be a number from 1 to {MAX_PAGE}")),
    };
    let before = match query.cursor.as_deref().map(decode_cursor) {
        None => None,
        Some(Some(c)) => Some(c),
        Some(None) => return invalid("cursor", "is not a cursor this server gave out".into()),
    };
    let filter = crate::store::ListFilter {
        state: job_state,
        workflow: query.workflow,
        since,
        owner: who.scope(),
        before,
        limit,
    };
    match state.store.list_jobs(&filter).await {
        Ok((jobs, more)) => {
            let next_cursor = more
                .then(|| jobs.last().map(|j| encode_cursor(j.created_at, &j.id)))
                .flatten();
            HttpResponse::Ok().json(json!({ "jobs": jobs, "next_cursor": next_cursor }))
        }
        Err(e) => unavailable(e),
    }
}

/// `GET /v1/stats`: jobs per state (every state), of the token's own jobs or,
/// for an admin token, of all.
async fn stats(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    let who = match authenticate(&state, &req).await {
        Ok(who) => who,
        Err(refused) => return refused,
    };
    match state.store.stats(who.scope()).await {
        Ok(counts) => {
            let states: serde_json::Map<String, serde_json::Value> = counts
                .into_iter()
                .map(|(s, n)| (s.as_str().to_owned(), json!(n)))
                .collect();
            HttpResponse::Ok().json(json!({ "states": states }))
        }
        Err(e) => unavailable(e),
    }
}

/// The console's files, embedded in the binary.
const CONSOLE_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");

/// Headers every console file carries: its own origin only, no framing.
fn console_response(content_type: &'static str, body: String) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        ))
        .insert_header(("x-content-type-options", "nosniff"))
        .insert_header(("referrer-policy", "no-referrer"))
        .insert_header(("cache-control", "no-cache"))
        .body(body)
}

/// `GET /`: the web console (it asks for a token itself, when one is needed).
async fn console_page(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused;
    }
    let trace_url = state.trace_url.as_deref().unwrap_or_default();
    let escaped = trace_url
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    console_response(
        "text/html; charset=utf-8",
        CONSOLE_HTML.replace("{{TRACE_URL}}", &escaped),
    )
}

async fn console_js() -> HttpResponse {
    console_response("text/javascript; charset=utf-8", CONSOLE_JS.to_owned())
}

async fn console_css() -> HttpResponse {
    console_response("text/css; charset=utf-8", CONSOLE_CSS.to_owned())
}

/// Open to anyone and any `Host` (load balancers probe by address): it
/// says nothing but whether the database answers.
async fn healthz(state: web::Data<ApiState>) -> HttpResponse {
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

async fn metrics(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
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

async fn not_found(req: HttpRequest) -> HttpResponse {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {} {}", req.method(), req.path()),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_answered_for_a_listen_address() {
        let loopback = Hosts::for_listen("127.0.0.1:8080".parse().unwrap(), &[]);
        assert!(loopback.allows(Some("127.0.0.1:8080")));
        assert!(loopback.allows(Some("LOCALHOST:8080")));
        assert!(!loopback.allows(Some("evil.example:8080")));
        assert!(!loopback.allows(Some("localhost:9090")));
        assert!(!loopback.allows(None));
        let public = Hosts::for_listen(
            "0.0.0.0:8080".parse().unwrap(),
            &["api.example.com".into(), "lb.internal:443".into()],
        );
        assert!(public.allows(Some("api.example.com")));
        assert!(public.allows(Some("api.example.com:8080")));
        assert!(public.allows(Some("lb.internal:443")));
        assert!(!public.allows(Some("localhost:8080")));
        assert!(Hosts::Any.allows(None));
    }
}
