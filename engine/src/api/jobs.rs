//! `POST /v1/jobs`, `GET /v1/jobs/{id}` and the paged `GET /v1/jobs`.

use super::*;

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
    payload: web::Payload,
) -> HttpResponse {
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return ApiError::new(
            Code::Draining,
            "this node is shutting down and takes no new jobs; retry (another node, or this one restarted)",
        )
        .retry_after(2)
        .into();
    }
    // A form or text/plain POST is what a web page can send cross-site
    // without a preflight: JSON only.
    if !is_json(&req) {
        return not_json();
    }
    // Refuse before reading the body when the backlog is full.
    match state.limits.admit(&state.store, who.owner()).await {
        Ok(Ok(())) => {}
        Ok(Err(message)) => return backlog_full(message),
        Err(e) => return unavailable(e),
    }
    let limit = state.body_limit;
    let _place = match hold_body(&state, &req, who.owner(), limit) {
        Ok(place) => place,
        Err(why) => return busy(why),
    };
    let too_large = || {
        error(
            Code::TooLarge,
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
    let body = match read_body(&state, payload, limit, too_large).await {
        Ok(body) => body,
        Err(refused) => return refused,
    };
    let job = match parse_job(&state, who, &body) {
        Ok(job) => job,
        Err(refused) => {
            let (code, message, field) = refused.parts();
            return error(code, message, field.as_deref());
        }
    };
    admit(&state, who, &req, job).await
}

/// Admits one parsed job through [`intake`] and answers as a submit does
/// (`201`, `200` for the identical job, `409`).
pub(super) async fn admit(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: crate::request::NewJob,
) -> HttpResponse {
    let result = intake(state, who, req, &job).await;
    intake_answer(who, &job.id, result)
}

/// Stores one parsed job the way every job that comes through the API is
/// stored (a submit, a batch's item, a re-run): the `submit` span
/// continuing the caller's trace, failure events only with a webhook, the
/// hand-off to this node when it has room, and the intake metric.
pub(super) async fn intake(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: &crate::request::NewJob,
) -> Result<Intake, crate::error::StoreError> {
    let job = job.clone();
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
        state.telemetry.metrics().jobs_submitted.add(
            1,
            &[
                KeyValue::new(WORKFLOW_NAME, job.workflow.clone()),
                KeyValue::new(SUBMIT_OUTCOME, outcome),
            ],
        );
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

/// `POST /v1/jobs`'s answer for what intake did.
fn intake_answer(
    who: Who,
    id: &str,
    result: Result<Intake, crate::error::StoreError>,
) -> HttpResponse {
    match result {
        Ok(Intake::Created(view)) => HttpResponse::Created().json(view),
        // Another token's job: the id is taken, and nothing more is said.
        Ok(Intake::Existing(view)) | Ok(Intake::Conflict(view)) if !who.sees(view.owner_token) => {
            error(
                Code::Conflict,
                format!("job id {id:?} is not available"),
                Some("id"),
            )
        }
        Ok(Intake::Existing(view)) => HttpResponse::Ok().json(view),
        Ok(Intake::Conflict(_)) => error(
            Code::Conflict,
            format!(
                "job {id:?} already exists with a different request; the stored job is unchanged"
            ),
            Some("id"),
        ),
        Ok(Intake::BacklogFull(limit)) => backlog_full(backlog_message(limit)),
        Err(e) => unavailable(e),
    }
}

#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, body = JobView),
        (status = 401, body = ErrorBody),
        (status = 404, description = "Unknown, or another token's", body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn get_job(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> HttpResponse {
    match state.store.jobs().get(&id).await {
        // Another token's job is as absent as a job that never was.
        Ok(Some(view)) if who.sees(view.owner_token) => HttpResponse::Ok().json(view),
        Ok(_) => error(Code::NotFound, format!("no job {:?}", id.as_str()), None),
        Err(e) => unavailable(e),
    }
}

/// The query of `GET /v1/jobs`: an unknown parameter is a `422` naming it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    state: Option<String>,
    workflow: Option<String>,
    since: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    waiting: Option<String>,
    tag: Option<String>,
}

/// `label:value`, as `?tag=` and a bulk cancel's `tag` take it.
pub(super) fn parse_tag(tag: &str) -> Result<(String, String), String> {
    match tag.split_once(':') {
        Some((k, v)) if crate::request::valid_tag_key(k) => Ok((k.to_owned(), v.to_owned())),
        _ => Err("must be label:value (a label of 1-64 characters of A-Z a-z 0-9 _ . -)".into()),
    }
}

/// The kinds of wait `GET /v1/jobs?waiting=` filters by.
const WAIT_KINDS: [&str; 8] = [
    "sleep",
    "signal",
    "approval",
    "children",
    "budget",
    "concurrency",
    "throttle",
    "provider",
];

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
    params(
        ("state" = Option<crate::JobState>, Query, description = "Only jobs in this state"),
        ("workflow" = Option<String>, Query, description = "Only this workflow's jobs"),
        ("waiting" = Option<String>, Query, pattern = "^(true|false|sleep|signal|approval|children|budget|concurrency|throttle|provider)$",
            description = "Only waiting jobs (`true`), the others (`false`), or the jobs waiting for one kind of thing (`sleep`, `signal`, `approval`, `children`, `budget`, `concurrency`, `throttle`, `provider`)"),
        ("since" = Option<chrono::DateTime<chrono::Utc>>, Query, description = "Created at or after (RFC 3339)"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 500, description = "1–500, default 50"),
        ("cursor" = Option<String>, Query, description = "`next_cursor` of the page before (opaque: any other value is a 422)"),
        ("tag" = Option<String>, Query, description = "Only jobs with this tag, `label:value`"),
    ),
    responses(
        (status = 200, description = "Newest first", body = JobPage),
        (status = 401, body = ErrorBody),
        (status = 422, description = "A bad parameter (named)", body = ErrorBody),
    ))]
pub(super) async fn list_jobs(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    req: HttpRequest,
) -> HttpResponse {
    let query = match web::Query::<ListQuery>::from_query(req.query_string()) {
        Ok(q) => q.into_inner(),
        Err(e) => return bad_query(&e),
    };
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
    let (waiting, waiting_kind) = match query.waiting.as_deref() {
        None => (None, None),
        Some("true") => (Some(true), None),
        Some("false") => (Some(false), None),
        Some(kind) if crate::store::COMPUTED_WAIT_KINDS.contains(&kind) => {
            (None, Some(kind.to_owned()))
        }
        Some(kind) if WAIT_KINDS.contains(&kind) => (Some(true), Some(kind.to_owned())),
        Some(_) => {
            return invalid(
                "waiting",
                format!("must be true, false, or a kind: {}", WAIT_KINDS.join(", ")),
            )
        }
    };
    let tag = match query.tag.as_deref().map(parse_tag) {
        None => None,
        Some(Ok(tag)) => Some(tag),
        Some(Err(message)) => return invalid("tag", message),
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
    match state.store.jobs().list(&filter).await {
        Ok((jobs, more)) => {
            let next_cursor = more
                .then(|| jobs.last().map(|j| encode_cursor(j.created_at, &j.id)))
                .flatten();
            HttpResponse::Ok().json(json!({ "jobs": jobs, "next_cursor": next_cursor }))
        }
        Err(e) => unavailable(e),
    }
}

/// Why a submission is refused, as `POST /v1/jobs` answers it.
pub(super) struct Refusal(IntakeError);

impl Refusal {
    /// The status, code, message and field of the answer.
    pub(super) fn parts(&self) -> (Code, String, Option<String>) {
        match &self.0 {
            IntakeError::Malformed(m) => (Code::MalformedJson, m.clone(), None),
            IntakeError::Invalid(e) => (Code::Invalid, e.to_string(), Some(e.field.clone())),
        }
    }
}

/// A `POST /v1/jobs` body checked as intake checks it, and a tenant's
/// priority within its bounds (an admin token's cuts across).
pub(super) fn parse_job(
    state: &ApiState,
    who: Who,
    body: &[u8],
) -> Result<crate::request::NewJob, Refusal> {
    let job = intake::parse(body, &state.registry, &state.url_guard).map_err(Refusal)?;
    if matches!(who, Who::Token(c) if !c.admin)
        && job.schedule.priority.abs() > intake::MAX_TENANT_PRIORITY
    {
        return Err(Refusal(
            crate::error::InvalidInput::new(
                "priority",
                format!(
                    "must be from -{m} to {m} for a token that is not admin",
                    m = intake::MAX_TENANT_PRIORITY
                ),
            )
            .into(),
        ));
    }
    Ok(job)
}

/// Why a job was refused when its token's backlog in the cluster is full.
pub(super) fn backlog_message(limit: u64) -> String {
    format!("this token has {limit} unfinished jobs, its limit; retry when some have finished")
}

/// `429 backlog_full` with `Retry-After`.
pub(super) fn backlog_full(message: String) -> HttpResponse {
    ApiError::new(Code::BacklogFull, message)
        .retry_after(5)
        .into()
}
