//! `POST /v1/jobs`, `GET /v1/jobs/{id}` and the paged `GET /v1/jobs`.

use super::*;
use crate::node::intake::SubmitJob;
use crate::rules::wait_machine::WaitKind;

#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", request_body = SubmitJob,
    responses(
        (status = 201, description = "Created", body = JobView),
        (status = 200, description = "The identical job again", body = JobView),
        (status = 400, description = "Not JSON", body = ErrorBody),
        (status = 401, description = "No or a bad token", body = ErrorBody),
        (status = 409, description = "The id with another request, or another token's", body = ErrorBody),
        (status = 413, description = "Too large", body = ErrorBody),
        (status = 415, description = "Not application/json", body = ErrorBody),
        (status = 422, description = "A field is wrong (named)", body = ErrorBody),
        (status = 429, description = "Backlog full, or `busy`: the node holds as many request bytes as it may", body = ErrorBody),
        (status = 503, description = "Draining or the database is down", body = ErrorBody),
    ))]
pub(super) async fn submit(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    Json(body, _held): Json<SubmitJob>,
) -> Answer {
    let job = intake::validate(body, &state.registry, &state.url_guard)?;
    let (status, view) = admit(&state, who, &req, job).await?;
    Ok(HttpResponse::build(status).json(view))
}

impl extract::Body for SubmitJob {
    fn limit(state: &ApiState) -> usize {
        state.body_limit
    }
    const JOBS: bool = true;
    const ADMITS: bool = true;
}

/// Admits one job, whatever way it came through the API (a submit, a
/// batch's item, a re-run), and answers as a submit does: `201` and the
/// job, `200` and the identical job, or the refusal. One path for all:
/// a tenant's priority within its bounds, the node's backlog bound, then
/// the store's intake (the cluster-wide per-token backlog, decided under
/// a lock) with the `submit` span continuing the caller's trace, failure
/// events only with a webhook, the hand-off to this node when it has
/// room, and the intake metric.
pub(super) async fn admit(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: crate::request::NewJob,
) -> Result<(StatusCode, crate::store::JobView), ApiError> {
    if matches!(who, Who::Token(c) if !c.admin)
        && job.schedule.priority.abs() > intake::MAX_TENANT_PRIORITY
    {
        return Err(error(
            Code::Invalid,
            format!(
                "priority: must be from -{m} to {m} for a token that is not admin",
                m = intake::MAX_TENANT_PRIORITY
            ),
            Some("priority"),
        ));
    }
    if let Err(message) = state
        .limits
        .admit(&state.store, who.owner())
        .await
        .map_err(unavailable)?
    {
        return Err(backlog_full(message));
    }
    let id = job.id.clone();
    match stored(state, who, req, job).await.map_err(unavailable)? {
        Intake::Created(view) => Ok((StatusCode::CREATED, view)),
        // Another token's job: the id is taken, and nothing more is said.
        Intake::Existing(view) | Intake::Conflict(view) if !who.sees(view.owner_token) => {
            Err(error(
                Code::Conflict,
                format!("job id {id:?} is not available"),
                Some("id"),
            ))
        }
        Intake::Existing(view) => Ok((StatusCode::OK, view)),
        Intake::Conflict(_) => Err(error(
            Code::Conflict,
            format!(
                "job {id:?} already exists with a different request; the stored job is unchanged"
            ),
            Some("id"),
        )),
        Intake::BacklogFull(limit) => Err(backlog_full(backlog_message(limit))),
    }
}

/// Stores one admitted job: the `submit` span, the hand-off, the metric.
async fn stored(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: crate::request::NewJob,
) -> Result<Intake, crate::error::StoreError> {
    let (mut span, trace) = submit_span(state, req, &job);
    // Failure events go where the completion would: nowhere without a webhook.
    let notify = state.registry.failure_events(&job.workflow) && !job.webhook_url.is_empty();
    let result = crate::node::handoff::submit(
        &state.store,
        state.handoff.as_ref(),
        crate::store::Submission::new(&job)
            .traced(trace)
            .owned(who.owner(), notify)
            .limited(state.limits.max_backlog_per_token),
    )
    .await;
    let outcome = match &result {
        Ok(Intake::Created(_)) => "created",
        Ok(Intake::Existing(_)) => "existing",
        Ok(Intake::Conflict(_)) => "conflict",
        Ok(Intake::BacklogFull(_)) => "backlog_full",
        Err(_) => "unavailable",
    };
    span.set_attribute(KeyValue::new(SUBMIT_OUTCOME, outcome));
    if result.is_err() {
        span.set_status(Status::error(outcome));
    }
    span.end();
    // Counted as the caller sees it: another token's job is a conflict.
    let counted = match &result {
        Ok(Intake::Created(_)) => true,
        Ok(Intake::Existing(view)) => who.sees(view.owner_token),
        _ => false,
    };
    if counted {
        crate::attempt_spans::count_intake(&state.telemetry, &job.workflow, outcome, 1);
    }
    result
}

/// The `submit` span, continuing the caller's trace when it sent one, and
/// the trace the job is stored with (so every attempt is the span's child).
fn submit_span(
    state: &ApiState,
    req: &HttpRequest,
    job: &crate::request::NewJob,
) -> (opentelemetry::global::BoxedSpan, TraceParent) {
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
    let span = tracer
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
    (span, trace)
}

#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, body = JobView),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown, or another token's", body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn get_job(_: Reader, OwnJob(view): OwnJob) -> Answer {
    Ok(HttpResponse::Ok().json(view))
}

// As parsed and as documented; each is read as text and checked by the
// handler, so a bad one is a `422` naming it.
/// The query of `GET /v1/jobs`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ListQuery {
    /// Only jobs in this state.
    #[param(value_type = Option<crate::JobState>)]
    state: Option<String>,
    /// Only this workflow's jobs.
    workflow: Option<String>,
    /// Created at or after (RFC 3339).
    #[param(value_type = Option<chrono::DateTime<chrono::Utc>>)]
    since: Option<String>,
    /// 1–500, default 50.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 500)]
    limit: Option<String>,
    /// `next_cursor` of the page before (opaque: any other value is a 422).
    cursor: Option<String>,
    /// Only waiting jobs (`true`), the others (`false`), or the jobs
    /// waiting for one kind of thing (`sleep`, `signal`, `approval`,
    /// `children`, `budget`, `concurrency`, `throttle`, `provider`).
    #[param(
        pattern = "^(true|false|sleep|signal|approval|children|budget|concurrency|throttle|provider)$"
    )]
    waiting: Option<String>,
    /// Only jobs with this tag, `label:value`.
    tag: Option<String>,
}

/// A page of `GET /v1/jobs`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct JobPage {
    jobs: Vec<crate::store::jobs::JobSummary>,
    /// Pass back as `cursor` for the next page; `null` on the last.
    next_cursor: Option<String>,
}

/// `label:value`, as `?tag=` and a bulk cancel's `tag` take it.
pub(super) fn parse_tag(tag: &str) -> Result<(String, String), String> {
    match tag.split_once(':') {
        Some((k, v)) if crate::request::valid_tag_key(k) => Ok((k.to_owned(), v.to_owned())),
        _ => Err("must be label:value (a label of 1-64 characters of A-Z a-z 0-9 _ . -)".into()),
    }
}

/// Largest page of `GET /v1/jobs`.
pub const MAX_PAGE: i64 = 500;

/// A keyset cursor: the last row of a page, as `created_at` (µs) and id,
/// URL-safe base64. Opaque to clients.
pub(super) fn encode_cursor(at: chrono::DateTime<chrono::Utc>, id: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(format!("{}|{id}", at.timestamp_micros()))
}

pub(super) fn decode_cursor(cursor: &str) -> Option<(chrono::DateTime<chrono::Utc>, String)> {
    use base64::Engine as _;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (micros, id) = text.split_once('|')?;
    let at = chrono::DateTime::from_timestamp_micros(micros.parse().ok()?)?;
    crate::node::intake::validate_id(id).ok()?;
    Some((at, id.to_owned()))
}

/// `GET /v1/jobs?state=&workflow=&waiting=&since=&limit=&cursor=`: newest first,
/// keyset-paginated; a token sees its own jobs, an admin token all.
#[utoipa::path(get, path = "/v1/jobs", tag = "jobs",
    params(ListQuery),
    responses(
        (status = 200, description = "Newest first", body = JobPage),
        (status = 401, body = ErrorBody),
        (status = 422, description = "A bad parameter (named)", body = ErrorBody),
    ))]
pub(super) async fn list_jobs(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    Query(query): Query<ListQuery>,
) -> Answer {
    let invalid = |field: &str, message: String| error(Code::Invalid, message, Some(field));
    let job_state = match query
        .state
        .as_deref()
        .map(str::parse::<crate::rules::lifecycle::JobState>)
    {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(_)) => {
            let names: Vec<&str> = crate::rules::lifecycle::JobState::ALL
                .iter()
                .map(|s| s.as_str())
                .collect();
            return Err(invalid(
                "state",
                format!("must be one of {}", names.join(", ")),
            ));
        }
    };
    let since = match query
        .since
        .as_deref()
        .map(chrono::DateTime::parse_from_rfc3339)
    {
        None => None,
        Some(Ok(t)) => Some(t.with_timezone(&chrono::Utc)),
        Some(Err(e)) => return Err(invalid("since", format!("must be an RFC 3339 time: {e}"))),
    };
    let limit = match query.limit.as_deref().map(str::parse::<i64>) {
        None => 50,
        Some(Ok(n)) if (1..=MAX_PAGE).contains(&n) => n,
        Some(_) => {
            return Err(invalid(
                "limit",
                format!("must be a number from 1 to {MAX_PAGE}"),
            ))
        }
    };
    let before = match query.cursor.as_deref().map(decode_cursor) {
        None => None,
        Some(Some(c)) => Some(c),
        Some(None) => {
            return Err(invalid(
                "cursor",
                "is not a cursor this server gave out".into(),
            ))
        }
    };
    let (waiting, waiting_kind) = match query.waiting.as_deref() {
        None => (None, None),
        Some("true") => (Some(true), None),
        Some("false") => (Some(false), None),
        Some(kind) if crate::store::COMPUTED_WAIT_KINDS.contains(&kind) => {
            (None, Some(kind.to_owned()))
        }
        Some(kind) if WaitKind::ALL.iter().any(|k| k.as_str() == kind) => {
            (Some(true), Some(kind.to_owned()))
        }
        Some(_) => {
            let kinds: Vec<&str> = WaitKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(invalid(
                "waiting",
                format!("must be true, false, or a kind: {}", kinds.join(", ")),
            ));
        }
    };
    let tag = match query.tag.as_deref().map(parse_tag) {
        None => None,
        Some(Ok(tag)) => Some(tag),
        Some(Err(message)) => return Err(invalid("tag", message)),
    };
    let filter = crate::store::ListFilter {
        tag,
        state: job_state,
        workflow: query.workflow,
        since,
        owner: who.scope(),
        before,
        limit,
        waiting,
        waiting_kind,
    };
    let (jobs, more) = state
        .store
        .jobs()
        .list(&filter)
        .await
        .map_err(unavailable)?;
    let next_cursor = more
        .then(|| jobs.last().map(|j| encode_cursor(j.created_at, &j.id)))
        .flatten();
    Ok(HttpResponse::Ok().json(JobPage { jobs, next_cursor }))
}

/// Why a job was refused when its token's backlog in the cluster is full.
pub(super) fn backlog_message(limit: u64) -> String {
    format!("this token has {limit} unfinished jobs, its limit; retry when some have finished")
}

/// `429 backlog_full` with `Retry-After`.
pub(super) fn backlog_full(message: String) -> ApiError {
    ApiError::new(Code::BacklogFull, message).retry_after(5)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document's `waiting` parameter names every kind of wait the
    /// wait machine has (it is written by hand in the attribute).
    #[test]
    fn the_waiting_parameter_names_every_kind() {
        let doc = super::super::openapi::document();
        let params = doc["paths"]["/v1/jobs"]["get"]["parameters"]
            .as_array()
            .unwrap();
        let waiting = params.iter().find(|p| p["name"] == "waiting").unwrap();
        let kinds: Vec<&str> = WaitKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            waiting["schema"]["pattern"],
            format!("^(true|false|{})$", kinds.join("|"))
        );
    }
}
