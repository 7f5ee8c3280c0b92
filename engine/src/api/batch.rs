//! `POST /v1/jobs/batch` `{"jobs": [job, …]}`: up to 1,000 submits in one
//! request, each checked, bounded and stored as `POST /v1/jobs` would, and
//! answered in order with the status and body a single submit would get.
//! One job's refusal never fails the others; each is idempotent by its id.

use super::*;
use crate::store::Intake;

/// Most jobs one batch submits.
pub const MAX_BATCH: usize = 1_000;

/// `200` `{"jobs": [{"status", "job"} | {"status", "error"}, …]}`, one
/// answer per job in the order sent · `400` malformed JSON · `413` a body
/// over 16 times the node's body limit · `415` · `422` not `{"jobs": […]}`
/// of 1 to 1,000 jobs.
#[utoipa::path(post, path = "/v1/jobs/batch", tag = "jobs", request_body = SubmitBatch,
    responses(
        (status = 200, description = "One answer per job, in order", body = BatchAnswer),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, description = "`busy`: the node holds as many request bytes as it may (`Retry-After`)", body = ErrorBody),
    ))]
pub(super) async fn submit_batch(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    if state.draining.load(std::sync::atomic::Ordering::Acquire) {
        return error(
            Code::Draining,
            "this node is shutting down and takes no new jobs; retry",
            None,
        );
    }
    if !is_json(&req) {
        return not_json();
    }
    let limit = state.body_limit.saturating_mul(16);
    let place = match hold_body(&state, &req, who.owner(), limit) {
        Ok(place) => place,
        Err(why) => return busy(why),
    };
    let body = match read_body(&state, payload, limit, || {
        error(
            Code::TooLarge,
            format!("a batch's body is at most {limit} bytes"),
            None,
        )
    })
    .await
    {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let jobs = match intake::parse_json(&body) {
        Ok(serde_json::Value::Object(mut obj)) => match (obj.remove("jobs"), obj.keys().next()) {
            (_, Some(extra)) => {
                return error(
                    Code::Invalid,
                    format!("{extra}: unknown field"),
                    Some(extra),
                )
            }
            (Some(serde_json::Value::Array(jobs)), None)
                if (1..=MAX_BATCH).contains(&jobs.len()) =>
            {
                if let Some(i) = jobs.iter().position(|j| !j.is_object()) {
                    let field = format!("jobs[{i}]");
                    return error(
                        Code::Invalid,
                        format!("{field}: must be a job, a JSON object"),
                        Some(&field),
                    );
                }
                jobs
            }
            _ => {
                return error(
                    Code::Invalid,
                    format!("jobs: must be an array of 1 to {MAX_BATCH} jobs"),
                    Some("jobs"),
                )
            }
        },
        Ok(_) => {
            return error(
                Code::Invalid,
                "body: must be {\"jobs\": [...]}",
                Some("body"),
            )
        }
        Err(e) => return error(Code::MalformedJson, e.to_string(), None),
    };
    // A few at a time, in order: the store batches concurrent inserts, and
    // the backlog count is read once, not once per job.
    use futures_util::StreamExt as _;
    let answers: Vec<serde_json::Value> = futures_util::stream::iter(jobs)
        .map(|job| submit_one(&state, who, &req, job))
        .buffered(16)
        .collect()
        .await;
    let answer = HttpResponse::Ok().json(json!({ "jobs": answers }));
    let held = body.len();
    drop((body, place));
    give_memory_back(held);
    answer
}

/// One job of a batch, answered as `POST /v1/jobs` would answer it.
async fn submit_one(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: serde_json::Value,
) -> serde_json::Value {
    let refused = |code: Code, message: String, field: Option<&str>| {
        json!({
            "status": code.status().as_u16(),
            "error": { "code": code.as_str(), "message": message, "field": field },
        })
    };
    let bytes = serde_json::to_vec(&job).expect("a JSON value serialises");
    if bytes.len() > state.body_limit {
        return refused(
            Code::TooLarge,
            format!("the job exceeds {} bytes", state.body_limit),
            None,
        );
    }
    let job = match super::jobs::parse_job(state, who, &bytes) {
        Ok(job) => job,
        Err(refusal) => {
            let (code, message, field) = refusal.parts();
            return refused(code, message, field.as_deref());
        }
    };
    match state.limits.admit(&state.store, who.owner()).await {
        Ok(Ok(())) => {}
        Ok(Err(message)) => return refused(Code::BacklogFull, message, None),
        Err(_) => {
            return refused(
                Code::Unavailable,
                "the database is unavailable; retry".into(),
                None,
            )
        }
    }
    let answer = |status: StatusCode, view: &crate::store::JobView| json!({ "status": status.as_u16(), "job": view });
    // Stored as a single submit is: span, hand-off, metric.
    match super::jobs::intake(state, who, req, &job).await {
        Ok(Intake::Created(view)) => answer(StatusCode::CREATED, &view),
        Ok(Intake::Existing(view)) | Ok(Intake::Conflict(view)) if !who.sees(view.owner_token) => {
            refused(
                Code::Conflict,
                format!("job id {:?} is not available", job.id),
                Some("id"),
            )
        }
        Ok(Intake::Existing(view)) => answer(StatusCode::OK, &view),
        Ok(Intake::BacklogFull(limit)) => {
            refused(Code::BacklogFull, super::jobs::backlog_message(limit), None)
        }
        Ok(Intake::Conflict(_)) => refused(
            Code::Conflict,
            format!(
                "job {:?} already exists with a different request; the stored job is unchanged",
                job.id
            ),
            Some("id"),
        ),
        Err(e) => {
            tracing::warn!(error = %e, job.id = %job.id, "a batch's job could not be stored");
            refused(
                Code::Unavailable,
                "the database is unavailable; retry".into(),
                None,
            )
        }
    }
}
