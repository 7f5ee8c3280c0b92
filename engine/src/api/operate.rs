//! An operator's actions: cancel, redrive, bulk redrive.

use super::*;
use crate::rules::lifecycle::JobState;

/// The optional body of cancel and redrive.
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Action {
    /// Why (kept in the job's history).
    reason: Option<String>,
}

impl extract::Body for Action {
    fn empty() -> Option<Self> {
        Some(Self::default())
    }
}

/// `POST /v1/jobs/redrive`: which dead jobs to redrive.
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct BulkRedrive {
    /// Why (kept in each job's history).
    reason: Option<String>,
    /// Only this workflow's dead jobs.
    workflow: Option<String>,
    /// At most this many (1–1,000, default 1,000).
    #[schema(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

impl extract::Body for BulkRedrive {
    fn empty() -> Option<Self> {
        Some(Self::default())
    }
}

/// `POST /v1/jobs/cancel`: which live jobs to cancel.
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct BulkCancel {
    /// Why (kept in each job's history).
    reason: Option<String>,
    /// Only jobs in this live state.
    #[schema(pattern = "^(received|generated|persisted|claimed|delivered)$")]
    state: Option<String>,
    /// Only this workflow's jobs.
    workflow: Option<String>,
    /// Only jobs with this tag, `label:value`.
    tag: Option<String>,
    /// At most this many, oldest first (1–1,000, default 1,000).
    #[schema(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

impl extract::Body for BulkCancel {
    fn empty() -> Option<Self> {
        Some(Self::default())
    }
}

/// What a bulk cancel did.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct BulkCancelled {
    /// Jobs cancelled now (their live children go with them, uncounted).
    cancelled: u64,
}

/// What a bulk redrive did.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct BulkRedriven {
    redriven: u64,
    /// Dead jobs whose webhook's (or a tool call's) outcome is unknown, left
    /// alone without `confirm_unknown`.
    skipped_unknown: u64,
}

/// The query of a redrive.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct RedriveQuery {
    /// Also resend webhooks, and call again tools that may not run twice,
    /// whose outcome is unknown (they may have reached the other side).
    confirm_unknown: Option<bool>,
}

/// `POST /v1/jobs/{id}/rerun`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Rerun {
    /// The new job's id (1–200 characters of `A-Z a-z 0-9 _ . : -`).
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
    id: String,
}

impl extract::Body for Rerun {}

/// A bulk action's `limit`: 1–1,000, 1,000 when not given; `None` out of it.
fn bulk_limit(limit: Option<i64>) -> Option<i64> {
    Some(limit.unwrap_or(1000)).filter(|l| (1..=1000).contains(l))
}

/// The answer to a bulk action's `limit` out of its range.
fn bad_bulk_limit() -> ApiError {
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
    Json(body, _held): Json<Action>,
    OwnJob(job): OwnJob,
) -> Answer {
    let id = job.id;
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Cancelled;
    let cancelled = state
        .store
        .jobs()
        .cancel(&id, &by, &reason)
        .await
        .map_err(unavailable)?;
    Err(match cancelled {
        Cancelled::Now | Cancelled::Already => {
            if matches!(cancelled, Cancelled::Now) {
                state
                    .telemetry
                    .metrics()
                    .transition(JobState::Cancelled.as_str());
            }
            let view = own_job(&state, who, &id).await?;
            return Ok(HttpResponse::Accepted().json(view));
        }
        Cancelled::Finished(s) => error(
            Code::Finished,
            format!("job {id:?} already finished as {s}; only a live job can be cancelled"),
            None,
        ),
        Cancelled::Missing => error(Code::NotFound, format!("no job {id:?}"), None),
        Cancelled::Delivering => ApiError::new(
            Code::Delivering,
            format!("job {id:?} is sending its webhook and the send has not ended; retry"),
        )
        .retry_after(5),
    })
}

/// `POST /v1/jobs/{id}/redrive` `{"reason"}`: `202` and the job resumed at
/// its last live state, with the same keys; `409` when it is not dead, or
/// when its webhook's outcome, or a tool call's that may not run twice, is
/// unknown and `?confirm_unknown=true` is absent.
#[utoipa::path(post, path = "/v1/jobs/{id}/redrive", tag = "operate", request_body = Option<Action>,
    params(("id" = String, Path), RedriveQuery),
    responses(
        (status = 202, body = JobView),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not dead, or its webhook's or a tool call's outcome is unknown (delivery_unknown, tool_outcome_unknown)", body = ErrorBody),
    ))]
pub(super) async fn redrive(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    Query(query): Query<RedriveQuery>,
    Json(body, _held): Json<Action>,
    OwnJob(job): OwnJob,
) -> Answer {
    let id = job.id;
    let confirm = query.confirm_unknown.unwrap_or(false);
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "no reason given".into());
    use crate::store::operate::Redriven;
    let redriven = state
        .store
        .jobs()
        .redrive(&id, &by, &reason, confirm)
        .await
        .map_err(unavailable)?;
    Err(match redriven {
        Redriven::Resumed(_) => {
            let view = own_job(&state, who, &id).await?;
            return Ok(HttpResponse::Accepted().json(view));
        }
        Redriven::NotDead(s) => error(
            Code::NotDead,
            format!("job {id:?} is {s}; only a dead job can be redriven"),
            None,
        ),
        Redriven::UnknownDelivery => error(
            Code::DeliveryUnknown,
            "its webhook may have reached the consumer (at-most-once, outcome unknown); \
             redrive with ?confirm_unknown=true to send it again under the same webhook-id",
            None,
        ),
        Redriven::UnknownToolCall => error(
            Code::ToolOutcomeUnknown,
            "a tool call that may not run twice was sent and its answer lost (it may have run); \
             redrive with ?confirm_unknown=true to call it again under the same key",
            None,
        ),
        Redriven::Missing => error(Code::NotFound, format!("no job {id:?}"), None),
    })
}

/// `POST /v1/jobs/redrive` `{"reason", "workflow"?, "limit"?}`: redrives the
/// caller's dead jobs (an admin token: everyone's), oldest death first,
/// skipping those whose delivery is unknown unless `?confirm_unknown=true`;
/// answers `{"redriven": n, "skipped_unknown": m}`.
#[utoipa::path(post, path = "/v1/jobs/redrive", tag = "operate", request_body = Option<BulkRedrive>,
    params(RedriveQuery),
    responses(
        (status = 202, body = BulkRedriven),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn redrive_bulk(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    Query(query): Query<RedriveQuery>,
    Json(body, _held): Json<BulkRedrive>,
) -> Answer {
    let confirm = query.confirm_unknown.unwrap_or(false);
    let limit = bulk_limit(body.limit).ok_or_else(bad_bulk_limit)?;
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "bulk redrive".into());
    let ids = state
        .store
        .jobs()
        .dead_ids(body.workflow.as_deref(), who.scope(), limit)
        .await
        .map_err(unavailable)?;
    let (mut redriven, mut skipped_unknown) = (0u64, 0u64);
    for id in ids {
        use crate::store::operate::Redriven;
        match state
            .store
            .jobs()
            .redrive(&id, &by, &reason, confirm)
            .await
            .map_err(unavailable)?
        {
            Redriven::Resumed(_) => redriven += 1,
            Redriven::UnknownDelivery | Redriven::UnknownToolCall => skipped_unknown += 1,
            Redriven::NotDead(_) | Redriven::Missing => {}
        }
    }
    Ok(HttpResponse::Accepted().json(BulkRedriven {
        redriven,
        skipped_unknown,
    }))
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
    Json(body, _held): Json<BulkCancel>,
) -> Answer {
    let limit = bulk_limit(body.limit).ok_or_else(bad_bulk_limit)?;
    let only =
        match body.state.as_deref().map(str::parse::<JobState>) {
            None => None,
            Some(Ok(s)) if !s.is_terminal() => Some(s),
            Some(_) => return Err(error(
                Code::Invalid,
                "state: must be a live state (received, generated, persisted, claimed, delivered)",
                Some("state"),
            )),
        };
    let tag = match body.tag.as_deref().map(super::jobs::parse_tag) {
        None => None,
        Some(Ok(tag)) => Some(tag),
        Some(Err(message)) => {
            return Err(error(Code::Invalid, format!("tag: {message}"), Some("tag")))
        }
    };
    let by = caller_name(&state, who).await;
    let reason = body.reason.unwrap_or_else(|| "bulk cancel".into());
    let ids = state
        .store
        .jobs()
        .live_ids(only, body.workflow.as_deref(), tag, who.scope(), limit)
        .await
        .map_err(unavailable)?;
    let mut cancelled = 0u64;
    for id in ids {
        use crate::store::operate::Cancelled;
        let now = state
            .store
            .jobs()
            .cancel(&id, &by, &reason)
            .await
            .map_err(unavailable)?;
        if matches!(now, Cancelled::Now) {
            cancelled += 1;
            state
                .telemetry
                .metrics()
                .transition(JobState::Cancelled.as_str());
        }
    }
    Ok(HttpResponse::Accepted().json(BulkCancelled { cancelled }))
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
    Json(body, _held): Json<Rerun>,
    OwnJob(original): OwnJob,
) -> Answer {
    crate::node::intake::validate_id(&body.id)?;
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return Err(error(
            Code::Draining,
            "this node is shutting down and takes no new jobs; retry",
            None,
        ));
    }
    // A re-run is a new job submitted with the original's request under
    // the new id: it passes the same checks a submit does (the workflow
    // registered, its input, the webhook URL's guard, a tenant's priority,
    // the backlog) and keeps the original's concurrency key, priority and
    // tags, so the key's limit and throttle bind it as they bound the
    // original.
    let request = crate::node::intake::SubmitJob {
        id: body.id,
        workflow: original.workflow,
        input: original.input,
        webhook_url: Some(original.webhook_url).filter(|url| !url.is_empty()),
        priority: Some(original.priority),
        concurrency_key: original.concurrency_key,
        tags: Some(original.tags.into_iter().collect()),
        run_at: None,
        delay_ms: None,
    };
    let job = crate::node::intake::validate(request, &state.registry, &state.url_guard)?;
    let (status, view) = super::jobs::admit(&state, who, &req, job).await?;
    Ok(HttpResponse::build(status).json(view))
}
