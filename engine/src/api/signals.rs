//! `POST /v1/jobs/{id}/signals/{name}` `{"id", "payload", "until"?}`: a signal for a
//! job's `ctx.wait_for_signal` (or an approval), recorded once under its id.

use super::*;
use crate::rules::signal::SignalBody as CheckedSignal;
pub use crate::rules::signal::MAX_SIGNAL_PAYLOAD;
use crate::store::waits::SignalOutcome;

// As parsed and as documented; its rules are checked by
// `CheckedSignal::checked`.
/// `POST /v1/jobs/{id}/signals/{name}`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SignalBody {
    /// The sender's id for this signal: the same id again is the same signal.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
    id: String,
    /// What it carries (at most 64 KiB).
    #[schema(value_type = Object)]
    payload: serde_json::Value,
    /// The `until` of the wait this decides, as `waiting` shows it: then the
    /// signal is recorded only while the job waits for this name with this
    /// due time (else `409 not_waiting`), so a decision on a wait that is
    /// over is never kept for a later wait of the same name.
    #[schema(format = DateTime)]
    until: Option<String>,
}

impl extract::Body for SignalBody {
    /// The payload's bound, and room for the id.
    fn limit(_: &ApiState) -> usize {
        MAX_SIGNAL_PAYLOAD + 4 * 1024
    }
    fn too_large(_: usize) -> ApiError {
        ApiError::new(
            Code::Invalid,
            format!("payload: at most {MAX_SIGNAL_PAYLOAD} bytes"),
        )
        .on("payload")
    }
}

/// `202` the signal, recorded now · `200` the same id and payload again ·
/// `409 signal_conflict` the same id with another payload · `409
/// job_finished` · `409 not_waiting` (with `until`: the job does not wait
/// for this name with that due time) · `409 wait_decided` (with `until`:
/// that wait has its decision already) · `409 too_many_signals` (the job
/// holds as many untaken signals as it may) · `404` an unknown job or another
/// token's · `422` a bad name, id, payload or `until` (or a payload over
/// 64 KiB).
#[utoipa::path(post, path = "/v1/jobs/{id}/signals/{name}", tag = "jobs", request_body = SignalBody,
    params(("id" = String, Path), ("name" = String, Path, pattern = "^[A-Za-z0-9_.:-]{1,200}$", description = "1–200 characters of A-Z a-z 0-9 _ . : -")),
    responses(
        (status = 202, description = "Recorded now", body = SignalView),
        (status = 200, description = "The identical signal again", body = SignalView),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "`signal_conflict`, `job_finished`, `not_waiting`, `wait_decided` or `too_many_signals`", body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn signal(
    _: Writer,
    state: web::Data<ApiState>,
    path: web::Path<(String, String)>,
    Json(body, _held): Json<SignalBody>,
    OwnJob(_): OwnJob,
) -> Answer {
    let (id, name) = path.into_inner();
    let body = CheckedSignal::checked(&name, body.id, body.payload, body.until.as_deref())?;
    let signal_id = body.id.clone();
    let outcome = state
        .store
        .waits()
        .signal(&id, &name, &body)
        .await
        .map_err(unavailable)?;
    Err(match outcome {
        SignalOutcome::Created(view) => return Ok(HttpResponse::Accepted().json(view)),
        SignalOutcome::Existing(view) => return Ok(HttpResponse::Ok().json(view)),
        SignalOutcome::Conflict => error(Code::SignalConflict,
            format!("signal {signal_id:?} of {name:?} was recorded with another payload; the stored one is unchanged"),
            Some("payload"),
        ),
        SignalOutcome::Finished => error(Code::JobFinished,
            format!("job {id:?} has finished; nothing waits for a signal any more"),
            None,
        ),
        SignalOutcome::NotWaiting => error(Code::NotWaiting,
            format!("job {id:?} is not waiting for {name:?} due at that `until`: that wait is over (or not reached); nothing was recorded"),
            Some("until"),
        ),
        SignalOutcome::Decided => error(Code::WaitDecided,
            format!("the wait of job {id:?} for {name:?} due at that `until` has its decision already; nothing was recorded"),
            Some("until"),
        ),
        SignalOutcome::TooMany => error(Code::TooManySignals,
            format!(
                "job {id:?} holds {} untaken signals (or {} bytes of them), as many as it may; nothing was recorded",
                crate::store::waits::MAX_UNTAKEN_SIGNALS,
                crate::store::waits::MAX_UNTAKEN_SIGNAL_BYTES
            ),
            None,
        ),
        SignalOutcome::NotFound => error(Code::NotFound,
            format!("no job {id:?}"),
            None,
        ),
    })
}
