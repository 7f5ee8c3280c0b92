//! `POST /v1/jobs/batch` `{"jobs": [job, …]}`: up to 1,000 submits in one
//! request, each checked, bounded and stored as `POST /v1/jobs` would, and
//! answered in order with the status and body a single submit would get.
//! One job's refusal never fails the others; each is idempotent by its id.

use super::*;
use crate::api::error::ErrorDetail;
use crate::node::intake::SubmitJob;

/// Most jobs one batch submits.
pub const MAX_BATCH: usize = 1_000;

/// `POST /v1/jobs/batch`: up to 1,000 jobs, each a `POST /v1/jobs` body.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SubmitBatch {
    /// The jobs (1–1,000), each a `SubmitJob` as `POST /v1/jobs` takes it,
    /// each checked and answered on its own (a job refused is its own
    /// item's `422`, never the batch's).
    #[schema(value_type = Vec<Object>, min_items = 1, max_items = 1000)]
    jobs: Vec<serde_json::Value>,
}

impl extract::Body for SubmitBatch {
    fn limit(state: &ApiState) -> usize {
        state.body_limit.saturating_mul(16)
    }
    fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            Code::TooLarge,
            format!("a batch's body is at most {limit} bytes"),
        )
    }
    const JOBS: bool = true;

    /// `{"jobs": [...]}` only: each job is checked on its own (a NUL or a
    /// bad field in one is that job's `422`, never the batch's).
    fn parse(value: serde_json::Value) -> Result<Self, crate::error::InvalidInput> {
        let serde_json::Value::Object(mut body) = value else {
            return Err(crate::error::InvalidInput::new(
                "body",
                "must be {\"jobs\": [...]}",
            ));
        };
        if let Some(extra) = body.keys().find(|k| k.as_str() != "jobs") {
            return Err(crate::error::InvalidInput::new(
                extra.clone(),
                "unknown field",
            ));
        }
        match body.remove("jobs") {
            Some(serde_json::Value::Array(jobs)) => Ok(SubmitBatch { jobs }),
            _ => Err(crate::error::InvalidInput::new(
                "jobs",
                format!("must be an array of 1 to {MAX_BATCH} jobs"),
            )),
        }
    }
}

/// One job's answer in a batch: its status, and the job or the error.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct BatchItem {
    /// What `POST /v1/jobs` would have answered (201, 200, 409, 422, 429, …).
    status: u16,
    /// The job (201, 200).
    #[serde(skip_serializing_if = "Option::is_none")]
    job: Option<crate::store::JobView>,
    /// Why not (any other status).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorDetail>,
}

/// `POST /v1/jobs/batch`'s answer: one per job, in the order sent.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct BatchAnswer {
    jobs: Vec<BatchItem>,
}

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
    Json(batch, _held): Json<SubmitBatch>,
) -> Answer {
    if !(1..=MAX_BATCH).contains(&batch.jobs.len()) {
        return Err(error(
            Code::Invalid,
            format!("jobs: must be an array of 1 to {MAX_BATCH} jobs"),
            Some("jobs"),
        ));
    }
    if let Some(i) = batch.jobs.iter().position(|j| !j.is_object()) {
        let field = format!("jobs[{i}]");
        return Err(error(
            Code::Invalid,
            format!("{field}: must be a job, a JSON object"),
            Some(&field),
        ));
    }
    // A few at a time, in order: the store batches concurrent inserts, and
    // the backlog count is read once, not once per job.
    use futures_util::StreamExt as _;
    let jobs: Vec<BatchItem> = futures_util::stream::iter(batch.jobs)
        .map(|job| submit_one(&state, who, &req, job))
        .buffered(16)
        .collect()
        .await;
    Ok(HttpResponse::Ok().json(BatchAnswer { jobs }))
}

/// One job of a batch, answered as `POST /v1/jobs` would answer it: parsed
/// into the same type, validated, and admitted through the same
/// [`admit`](super::jobs::admit).
async fn submit_one(
    state: &ApiState,
    who: Who,
    req: &HttpRequest,
    job: serde_json::Value,
) -> BatchItem {
    let bytes = serde_json::to_vec(&job)
        .expect("a JSON value serialises")
        .len();
    let answer = if bytes > state.body_limit {
        Err(ApiError::new(
            Code::TooLarge,
            format!("the job exceeds {} bytes", state.body_limit),
        ))
    } else {
        match intake::typed::<SubmitJob>(job)
            .and_then(|job| intake::validate(job, &state.registry, &state.url_guard))
        {
            Ok(job) => super::jobs::admit(state, who, req, job).await,
            Err(e) => Err(e.into()),
        }
    };
    match answer {
        Ok((status, view)) => BatchItem {
            status: status.as_u16(),
            job: Some(view),
            error: None,
        },
        Err(e) => BatchItem {
            status: e.code.status().as_u16(),
            job: None,
            error: Some(e.detail()),
        },
    }
}
