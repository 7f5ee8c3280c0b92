//! The front door as extractors: what every handler's request passes
//! before the handler runs, each in one place.
//!
//! - [`Reader`] / [`Writer`] (in `auth`): the `Host`, a write not sent by
//!   another site's page, the token — worked out once per request
//!   ([`caller`]) and shared by the extractors below.
//! - [`Json`]: every JSON body — its content type (`415`), its size
//!   (`413`), its arrival within the body timeout (`408`), one JSON value
//!   with no key twice (`400`), no NUL anywhere, no unknown field, each
//!   field of its type (`422` naming the field) — parsed into the very type
//!   the OpenAPI document describes ([`Body`]). A job's body is also held
//!   under the node's (and the token's) bound on request bytes at once
//!   (`429 busy`), and refused while the node drains (`503`).
//! - [`Query`]: a query string into its type; a parameter the type does
//!   not take is a `422` naming it (the `hygiene` middleware refuses, from
//!   the document, the parameters of operations that take none).
//! - [`OwnJob`]: the `{id}` of the path as a job the caller may see, or
//!   `404` (another token's job is as absent as one that never was).

use std::rc::Rc;

use actix_web::HttpMessage as _;
use futures_util::future::LocalBoxFuture;
use serde::de::DeserializeOwned;

use super::*;

/// The caller, through the front door's checks: the `Host` (else `421`),
/// for a write a request not sent by another site's page (else `403`),
/// both checked on every call, and the token (else `401`), looked up once
/// per request and kept in it — [`Writer`], [`Json`], [`Query`] and
/// [`OwnJob`] all ask.
pub(super) async fn caller(req: &HttpRequest, write: bool) -> Result<Who, ApiError> {
    let state = state_of(req);
    let refused =
        misdirected(&state, req).or_else(|| if write { cross_site(&state, req) } else { None });
    if let Some(refused) = refused {
        return Err(refused);
    }
    let cell = {
        let mut extensions = req.extensions_mut();
        match extensions.get::<Rc<tokio::sync::OnceCell<Who>>>() {
            Some(cell) => cell.clone(),
            None => {
                let cell = Rc::new(tokio::sync::OnceCell::new());
                extensions.insert(cell.clone());
                cell
            }
        }
    };
    cell.get_or_try_init(|| async { authenticate(&state, req).await })
        .await
        .copied()
}

fn state_of(req: &HttpRequest) -> web::Data<ApiState> {
    req.app_data::<web::Data<ApiState>>()
        .cloned()
        .expect("the API's state is registered with every route")
}

/// A request body the API takes: a type that is both what the handler
/// reads and what the OpenAPI document describes.
pub(super) trait Body: DeserializeOwned + 'static {
    /// Largest body read, in bytes (an action's: 16 KiB).
    fn limit(_state: &ApiState) -> usize {
        16 * 1024
    }

    /// The answer to a body over [`limit`](Body::limit).
    fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            Code::TooLarge,
            format!("the request body exceeds {limit} bytes"),
        )
    }

    /// What no body (or `null`) stands for; `None` when one is required.
    fn empty() -> Option<Self> {
        None
    }

    /// A body of jobs (a submit, a batch): refused while the node drains,
    /// and held under the node's bound on request bytes at once.
    const JOBS: bool = false;

    /// Refused before it is read when the node's or the token's backlog is
    /// full (a submit; a batch's jobs are each answered on their own).
    const ADMITS: bool = false;

    /// The parsed value as `Self`, or the field at fault (by default: no
    /// NUL anywhere, no unknown field, each of its type).
    fn parse(value: serde_json::Value) -> Result<Self, crate::error::InvalidInput> {
        crate::node::intake::typed(value)
    }
}

/// A body, parsed and checked, and its place under the node's bound on
/// request bytes (given back, with the memory, when the handler is done).
pub(super) struct Json<T>(pub(super) T, pub(super) Held);

/// A body's place under the node's bound on request bytes held at once.
pub(super) struct Held {
    _place: Option<bounds::BodyPlace>,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        give_memory_back(self.bytes);
    }
}

/// The `415` for a body that is not JSON.
fn not_json() -> ApiError {
    ApiError::new(
        Code::UnsupportedMediaType,
        "the body must be JSON, sent with Content-Type: application/json",
    )
}

/// Whether the request says its body is JSON (`Content-Type: application/json`).
fn is_json(req: &HttpRequest) -> bool {
    req.headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// The body's declared length, if it declares one.
fn declared_length(req: &HttpRequest) -> Option<usize> {
    req.headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

impl<T: Body> actix_web::FromRequest for Json<T> {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, payload: &mut actix_web::dev::Payload) -> Self::Future {
        let (req, payload) = (req.clone(), payload.take());
        // Dropped when the body is in or refused (see `BodyInFlight`).
        let (done, in_flight) = tokio::sync::oneshot::channel::<()>();
        req.extensions_mut()
            .insert(BodyInFlight(std::cell::RefCell::new(Some(in_flight))));
        Box::pin(async move {
            let _done = done;
            let who = caller(&req, true).await?;
            let state = state_of(&req);
            if T::JOBS && state.draining.load(std::sync::atomic::Ordering::Acquire) {
                return Err(ApiError::new(
                    Code::Draining,
                    "this node is shutting down and takes no new jobs; retry (another node, or this one restarted)",
                )
                .retry_after(2));
            }
            // A form or text/plain POST is what a web page can send
            // cross-site without a preflight: JSON only (an optional body
            // may be absent).
            let optional = T::empty().is_some();
            if !optional && !is_json(&req) {
                return Err(not_json());
            }
            if T::ADMITS {
                // Refused before any of it is read; the place is taken at
                // intake (`jobs::admit`), once.
                let full = state
                    .limits
                    .backlog_full(&state.store, who.owner())
                    .await
                    .map_err(ApiError::unavailable)?;
                if let Some(message) = full {
                    return Err(super::jobs::backlog_full(message));
                }
            }
            let limit = T::limit(&state);
            let place = if T::JOBS {
                // Its declared length, or the limit when it declares none:
                // nothing of it is read without room.
                let bytes = declared_length(&req).map_or(limit, |n| n.min(limit));
                let place = state
                    .limits
                    .hold_body(who.owner(), bytes)
                    .map_err(|why| ApiError::new(Code::Busy, why).retry_after(1))?;
                Some(place)
            } else {
                None
            };
            if declared_length(&req).is_some_and(|n| n > limit) {
                return Err(T::too_large(limit));
            }
            let body = read(&state, payload, limit, T::too_large).await?;
            let held = Held {
                _place: place,
                bytes: body.len(),
            };
            if body.is_empty() {
                if let Some(empty) = T::empty() {
                    return Ok(Json(empty, held));
                }
            }
            if !is_json(&req) {
                return Err(not_json());
            }
            let value = crate::node::intake::parse_json(&body)
                .map_err(|e| ApiError::new(Code::MalformedJson, e.to_string()))?;
            drop(body);
            if value.is_null() {
                if let Some(empty) = T::empty() {
                    return Ok(Json(empty, held));
                }
            }
            let parsed = T::parse(value)
                .map_err(|e| ApiError::new(Code::Invalid, e.to_string()).on(e.field))?;
            Ok(Json(parsed, held))
        })
    }
}

/// Reads a body of at most `limit` bytes within the body timeout (a
/// dribbled body cannot hold a connection).
async fn read(
    state: &ApiState,
    mut payload: actix_web::dev::Payload,
    limit: usize,
    too_large: fn(usize) -> ApiError,
) -> Result<web::BytesMut, ApiError> {
    let mut body = web::BytesMut::new();
    let reading = async {
        while let Some(chunk) = payload.next().await {
            let chunk = chunk
                .map_err(|_| ApiError::new(Code::BadBody, "could not read the request body"))?;
            if body.len() + chunk.len() > limit {
                return Err(too_large(limit));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match actix_web::rt::time::timeout(state.limits.body_timeout, reading).await {
        Ok(read) => read?,
        Err(_) => return Err(body_timed_out(&state.limits)),
    }
    Ok(body)
}

/// A query string as `T` (which should deny unknown fields): a parameter
/// it does not take, or one of the wrong type, is a `422` naming it.
pub(super) struct Query<T>(pub(super) T);

impl<T: DeserializeOwned + 'static> actix_web::FromRequest for Query<T> {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move {
            // Who asks first: a stranger's bad query is a 401, not a 422.
            caller(&req, false).await?;
            web::Query::<T>::from_query(req.query_string())
                .map(|q| Query(q.into_inner()))
                .map_err(|e| bad_query(&e))
        })
    }
}

/// A body being read by a [`Json`] extractor placed before an [`OwnJob`]:
/// the job is looked up once the body is in (or refused), so a bad or
/// dribbled body is answered as such whatever the job, and costs no lookup.
struct BodyInFlight(std::cell::RefCell<Option<tokio::sync::oneshot::Receiver<()>>>);

/// The job the path's `{id}` names, when the caller may see it (after the
/// request's body, when a [`Json`] before it reads one).
pub(super) struct OwnJob(pub(super) crate::store::JobView);

impl actix_web::FromRequest for OwnJob {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let req = req.clone();
        let body = req
            .extensions()
            .get::<BodyInFlight>()
            .and_then(|b| b.0.borrow_mut().take());
        Box::pin(async move {
            if let Some(body) = body {
                let _ = body.await;
            }
            let write = !matches!(
                *req.method(),
                actix_web::http::Method::GET | actix_web::http::Method::HEAD
            );
            let who = caller(&req, write).await?;
            let id = req.match_info().get("id").unwrap_or_default().to_owned();
            let state = state_of(&req);
            own_job(&state, who, &id).await.map(OwnJob)
        })
    }
}

/// The job `id` if `who` may see it, else `404` (another token's job is as
/// absent as one that never was).
pub(super) async fn own_job(
    state: &ApiState,
    who: Who,
    id: &str,
) -> Result<crate::store::JobView, ApiError> {
    match state.store.jobs().get(id).await {
        Ok(Some(view)) if who.sees(view.owner_token) => Ok(view),
        Ok(_) => Err(ApiError::new(Code::NotFound, format!("no job {id:?}"))),
        Err(e) => Err(ApiError::unavailable(e)),
    }
}
