//! An operator's actions: cancel, redrive, bulk redrive.

use super::*;
use crate::rules::lifecycle::JobState;

/// The body of an operator's action: why.
#[derive(Debug, Default)]
pub(super) struct ActionBody {
    reason: Option<String>,
    /// Bulk cancel: only jobs in this live state.
    state: Option<String>,
    /// Bulk cancel: only jobs with this tag (`label:value`).
    tag: Option<String>,
    /// Bulk redrive: only this workflow's dead jobs.
    workflow: Option<String>,
    /// Bulk redrive: at most this many (default and most 1,000).
    limit: Option<i64>,
}

/// Reads an action's optional JSON body (at most 16 KiB, within the
/// intake's body timeout, so a dribbled body cannot hold a connection).
/// A field the action does not take (`takes`) is a `422` naming it.
pub(super) async fn action_body(
    state: &ApiState,
    req: &HttpRequest,
    payload: web::Payload,
    takes: &[&str],
) -> Result<ActionBody, HttpResponse> {
    let body = read_body(state, payload, 16 * 1024, || {
        error(Code::TooLarge, "an action's body is at most 16 KiB", None)
    })
    .await?;
    if body.is_empty() {
        return Ok(ActionBody::default());
    }
    if !is_json(req) {
        return Err(not_json());
    }
    // `null` is no body, as an empty one is. A field of the wrong type is
    // a `422` naming it, as at intake (`"limit": 99.0` as `"priority": 1.0`).
    let invalid = |field: &str, message: &str| {
        error(
            Code::InvalidRequest,
            format!("{field}: {message}"),
            Some(field),
        )
    };
    let mut fields = match crate::node::intake::parse_json(&body) {
        Ok(serde_json::Value::Null) => return Ok(ActionBody::default()),
        Ok(serde_json::Value::Object(map)) => {
            if let Some(extra) = map.keys().find(|k| !takes.contains(&k.as_str())) {
                return Err(invalid(extra, "unknown field"));
            }
            map
        }
        Ok(_) => return Err(invalid("body", "must be a JSON object")),
        Err(e) => return Err(error(Code::MalformedJson, e.to_string(), None)),
    };
    let mut text = |field: &'static str| match fields.remove(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(t)) if t.contains('\0') => {
            Err((field, "contains a NUL character"))
        }
        Some(serde_json::Value::String(t)) => Ok(Some(t)),
        Some(_) => Err((field, "must be a string")),
    };
    let reason = text("reason").map_err(|(f, m)| invalid(f, m))?;
    let job_state = text("state").map_err(|(f, m)| invalid(f, m))?;
    let tag = text("tag").map_err(|(f, m)| invalid(f, m))?;
    let workflow = text("workflow").map_err(|(f, m)| invalid(f, m))?;
    let limit = match fields.remove("limit") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| invalid("limit", "must be an integer from 1 to 1000"))?,
        ),
    };
    if let Some(extra) = fields.keys().next() {
        return Err(invalid(extra, "unknown field"));
    }
    let parsed = ActionBody {
        reason,
        state: job_state,
        tag,
        workflow,
        limit,
    };
    Ok(parsed)
}

/// A bulk action's `limit`: 1–1,000, 1,000 when not given; `None` out of it.
fn bulk_limit(limit: Option<i64>) -> Option<i64> {
    Some(limit.unwrap_or(1000)).filter(|l| (1..=1000).contains(l))
}

/// The answer to a bulk action's `limit` out of its range.
fn bad_bulk_limit() -> HttpResponse {
    error(
        Code::Invalid,
        "limit: must be from 1 to 1000",
        Some("limit"),
    )
}

/// How a caller is named in history rows.
pub(super) async fn caller_name(state: &ApiState, who: Who) -> String {
    match who {
        Who::Anyone => "api".to_owned(),
        Who::Token(c) => match state.store.tokens().name(c.token).await {
            Ok(Some(name)) => format!("token:{name}"),
            _ => format!("token#{}", c.token),
        },
    }
}

/// The job `id` if `who` may act on it, else the answer to give.
pub(super) async fn own_job(
    state: &ApiState,
    who: Who,
    id: &str,
) -> Result<crate::store::JobView, HttpResponse> {
    match state.store.jobs().get(id).await {
        Ok(Some(view)) if who.sees(view.owner_token) => Ok(view),
        Ok(_) => Err(error(Code::NotFound, format!("no job {id:?}"), None)),
        Err(e) => Err(unavailable(e)),
    }
}

/// `POST /v1/jobs/{id}/cancel` `{"reason"}`: `202` and the job once it is
/// `cancelled` (also when it already was); `409` when it finished first.
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", tag = "operate", request_body = Option<Action>,
    params(("id" = String, Path)),
    responses(
        (status = 202, body = JobView),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Already finished (it may have finished while the cancel waited for its webhook on the wire), or `delivering`: a send outlasted the wait", body = ErrorBody),
    ))]
pub(super) async fn cancel(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
    payload: web::Payload,
) -> HttpResponse {
    let body = match action_body(&state, &req, payload, &["reason"]).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Cancelled;
    let cancelled = state.store.jobs().cancel(&id, &by, &reason).await;
    if let Ok(Cancelled::Now) = cancelled {
        state
            .telemetry
            .metrics()
            .transition(crate::rules::lifecycle::JobState::Cancelled.as_str());
    }
    match cancelled {
        Ok(Cancelled::Now | Cancelled::Already) => match state.store.jobs().get(&id).await {
            Ok(Some(view)) => HttpResponse::Accepted().json(view),
            Ok(None) => error(Code::NotFound, format!("no job {:?}", id.as_str()), None),
            Err(e) => unavailable(e),
        },
        Ok(Cancelled::Finished(s)) => error(
            Code::Finished,
            format!(
                "job {:?} already finished as {s}; only a live job can be cancelled",
                id.as_str()
            ),
            None,
        ),
        Ok(Cancelled::Missing) => error(Code::NotFound, format!("no job {:?}", id.as_str()), None),
        Ok(Cancelled::Delivering) => ApiError::new(
            Code::Delivering,
            format!(
                "job {:?} is sending its webhook and the send has not ended; retry",
                id.as_str()
            ),
        )
        .retry_after(5)
        .into(),
        Err(e) => unavailable(e),
    }
}

#[derive(Debug, serde::Deserialize)]
pub(super) struct RedriveQuery {
    confirm_unknown: Option<bool>,
}

/// `POST /v1/jobs/{id}/redrive` `{"reason"}`: `202` and the job resumed at
/// its last live state, with the same keys; `409` when it is not dead, or
/// when its webhook's outcome is unknown and `?confirm_unknown=true` is absent.
#[utoipa::path(post, path = "/v1/jobs/{id}/redrive", tag = "operate", request_body = Option<Action>,
    params(("id" = String, Path), ("confirm_unknown" = Option<bool>, Query)),
    responses(
        (status = 202, body = JobView),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not dead, or its webhook's outcome is unknown", body = ErrorBody),
    ))]
pub(super) async fn redrive(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
    payload: web::Payload,
) -> HttpResponse {
    let confirm = match web::Query::<RedriveQuery>::from_query(req.query_string()) {
        Ok(q) => q.confirm_unknown.unwrap_or(false),
        Err(e) => return error(Code::BadQuery, e.to_string(), Some("confirm_unknown")),
    };
    let body = match action_body(&state, &req, payload, &["reason"]).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Redriven;
    match state.store.jobs().redrive(&id, &by, &reason, confirm).await {
        Ok(Redriven::Resumed(_)) => match state.store.jobs().get(&id).await {
            Ok(Some(view)) => HttpResponse::Accepted().json(view),
            Ok(None) => error(Code::NotFound, format!("no job {:?}", id.as_str()), None),
            Err(e) => unavailable(e),
        },
        Ok(Redriven::NotDead(s)) => error(
            Code::NotDead,
            format!(
                "job {:?} is {s}; only a dead job can be redriven",
                id.as_str()
            ),
            None,
        ),
        Ok(Redriven::UnknownDelivery) => error(
            Code::DeliveryUnknown,
            "its webhook may have reached the consumer (at-most-once, outcome unknown); \
             redrive with ?confirm_unknown=true to send it again under the same webhook-id",
            None,
        ),
        Ok(Redriven::Missing) => error(Code::NotFound, format!("no job {:?}", id.as_str()), None),
        Err(e) => unavailable(e),
    }
}

/// `POST /v1/jobs/redrive` `{"reason", "workflow"?, "limit"?}`: redrives the
/// caller's dead jobs (an admin token: everyone's), oldest death first,
/// skipping those whose delivery is unknown unless `?confirm_unknown=true`;
/// answers `{"redriven": n, "skipped_unknown": m}`.
#[utoipa::path(post, path = "/v1/jobs/redrive", tag = "operate", request_body = Option<BulkRedrive>,
    params(("confirm_unknown" = Option<bool>, Query, description = "Also resend webhooks whose outcome is unknown")),
    responses(
        (status = 202, body = BulkRedriven),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn redrive_bulk(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    let confirm = match web::Query::<RedriveQuery>::from_query(req.query_string()) {
        Ok(q) => q.confirm_unknown.unwrap_or(false),
        Err(e) => return error(Code::BadQuery, e.to_string(), Some("confirm_unknown")),
    };
    let body = match action_body(&state, &req, payload, &["reason", "workflow", "limit"]).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let Some(limit) = bulk_limit(body.limit) else {
        return bad_bulk_limit();
    };
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "bulk redrive".into());
    let ids = match state
        .store
        .jobs()
        .dead_ids(body.workflow.as_deref(), who.scope(), limit)
        .await
    {
        Ok(ids) => ids,
        Err(e) => return unavailable(e),
    };
    let (mut redriven, mut skipped) = (0u64, 0u64);
    for id in ids {
        use crate::store::operate::Redriven;
        match state.store.jobs().redrive(&id, &by, &reason, confirm).await {
            Ok(Redriven::Resumed(_)) => redriven += 1,
            Ok(Redriven::UnknownDelivery) => skipped += 1,
            Ok(Redriven::NotDead(_) | Redriven::Missing) => {}
            Err(e) => return unavailable(e),
        }
    }
    HttpResponse::Accepted().json(json!({ "redriven": redriven, "skipped_unknown": skipped }))
}

/// `POST /v1/jobs/cancel` `{"reason", "state"?, "workflow"?, "limit"?}`:
/// cancels the caller's live jobs (an admin token: everyone's), oldest
/// first, each as `POST /v1/jobs/{id}/cancel` would (with its live
/// children); answers `{"cancelled": n}`.
#[utoipa::path(post, path = "/v1/jobs/cancel", tag = "operate", request_body = Option<BulkCancel>,
    responses(
        (status = 202, body = BulkCancelled),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn cancel_bulk(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    let body = match action_body(
        &state,
        &req,
        payload,
        &["reason", "state", "workflow", "tag", "limit"],
    )
    .await
    {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let Some(limit) = bulk_limit(body.limit) else {
        return bad_bulk_limit();
    };
    let only =
        match body.state.as_deref().map(str::parse::<JobState>) {
            None => None,
            Some(Ok(s)) if !s.is_terminal() => Some(s),
            Some(_) => return error(
                Code::Invalid,
                "state: must be a live state (received, generated, persisted, claimed, delivered)",
                Some("state"),
            ),
        };
    let tag = match body.tag.as_deref().map(super::jobs::parse_tag) {
        None => None,
        Some(Ok(tag)) => Some(tag),
        Some(Err(message)) => return error(Code::Invalid, format!("tag: {message}"), Some("tag")),
    };
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "bulk cancel".into());
    let ids = match state
        .store
        .jobs()
        .live_ids(only, body.workflow.as_deref(), tag, who.scope(), limit)
        .await
    {
        Ok(ids) => ids,
        Err(e) => return unavailable(e),
    };
    let mut cancelled = 0u64;
    for id in ids {
        use crate::store::operate::Cancelled;
        match state.store.jobs().cancel(&id, &by, &reason).await {
            Ok(Cancelled::Now) => {
                cancelled += 1;
                state
                    .telemetry
                    .metrics()
                    .transition(JobState::Cancelled.as_str());
            }
            Ok(_) => {}
            Err(e) => return unavailable(e),
        }
    }
    HttpResponse::Accepted().json(json!({ "cancelled": cancelled }))
}

/// The body of `POST /v1/jobs/{id}/rerun`: the new job's id.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RerunBody {
    id: String,
}

/// `POST /v1/jobs/{id}/rerun` `{"id": new id}`: a new job with the
/// workflow, input and webhook of job `id` (any state), under the new id
/// and the workflow's current version: `201` and the new job · `200` the
/// same rerun again (idempotent by the new id) · `409` the new id holds
/// another job · `404` · `422` a bad new id, or a workflow this node no
/// longer runs.
#[utoipa::path(post, path = "/v1/jobs/{id}/rerun", tag = "operate", request_body = Rerun,
    params(("id" = String, Path)),
    responses(
        (status = 201, body = JobView),
        (status = 200, description = "The same rerun again", body = JobView),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The new id holds another job", body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, description = "The backlog is full (`Retry-After`)", body = ErrorBody),
    ))]
pub(super) async fn rerun(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    id: web::Path<String>,
    payload: web::Payload,
) -> HttpResponse {
    if !is_json(&req) {
        return not_json();
    }
    let body = match read_body(&state, payload, 16 * 1024, || {
        error(Code::TooLarge, "a rerun's body is at most 16 KiB", None)
    })
    .await
    {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let new_id = match serde_json::from_slice::<RerunBody>(&body) {
        Ok(b) => b.id,
        Err(e) if e.is_data() => {
            return error(
                Code::Invalid,
                format!("body: {e} (expected {{\"id\": \"<new job id>\"}})"),
                Some("id"),
            )
        }
        Err(e) => return error(Code::MalformedJson, e.to_string(), None),
    };
    if let Err(e) = crate::node::intake::validate_id(&new_id) {
        return error(Code::Invalid, e.to_string(), Some("id"));
    }
    let original = match own_job(&state, who, &id).await {
        Ok(view) => view,
        Err(refused) => return refused,
    };
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return error(
            Code::Draining,
            "this node is shutting down and takes no new jobs; retry",
            None,
        );
    }
    // A re-run is a new job submitted with the original's request under
    // the new id: it passes the same checks a submit does (the workflow
    // registered, its input, the webhook URL's guard, a tenant's priority)
    // and keeps the original's concurrency key, priority and tags, so the
    // key's limit and throttle bind it as they bound the original.
    let mut request = serde_json::json!({
        "id": new_id,
        "workflow": original.workflow,
        "input": original.input,
        "priority": original.priority,
        "tags": original.tags,
    });
    if !original.webhook_url.is_empty() {
        request["webhook_url"] = original.webhook_url.clone().into();
    }
    if let Some(key) = &original.concurrency_key {
        request["concurrency_key"] = key.clone().into();
    }
    let job = match super::jobs::parse_job(&state, who, request.to_string().as_bytes()) {
        Ok(job) => job,
        Err(refused) => {
            let (code, message, field) = refused.parts();
            return error(code, message, field.as_deref());
        }
    };
    // A rerun is a new job: it takes a place in the backlog as a submit does.
    match state.limits.admit(&state.store, who.owner()).await {
        Ok(Ok(())) => {}
        Ok(Err(message)) => return super::jobs::backlog_full(message),
        Err(e) => return unavailable(e),
    }
    super::jobs::admit(&state, who, &req, job).await
}
