//! `POST /v1/jobs/{id}/signals/{name}` `{"id", "payload", "until"?}`: a signal for a
//! job's `ctx.wait_for_signal` (or an approval), recorded once under its id.

use super::*;
use crate::rules::signal::SignalBody as CheckedSignal;
pub use crate::rules::signal::MAX_SIGNAL_PAYLOAD;
use crate::store::waits::SignalOutcome;

/// Reads a signal's JSON body (within the intake's body timeout; at most
/// the payload's bound plus room for the id) and checks it
/// ([`CheckedSignal::parse`]).
async fn signal_body(
    state: &ApiState,
    req: &HttpRequest,
    payload: web::Payload,
    name: &str,
) -> Result<CheckedSignal, HttpResponse> {
    if !is_json(req) {
        return Err(not_json());
    }
    let body = read_body(state, payload, MAX_SIGNAL_PAYLOAD + 4 * 1024, || {
        error(
            Code::Invalid,
            format!("payload: at most {MAX_SIGNAL_PAYLOAD} bytes"),
            Some("payload"),
        )
    })
    .await?;
    let value = crate::node::intake::parse_json(&body)
        .map_err(|e| error(Code::MalformedJson, e.to_string(), None))?;
    CheckedSignal::parse(name, value).map_err(|e| error(Code::Invalid, e.message, Some(&e.field)))
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
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
    payload: web::Payload,
) -> HttpResponse {
    let (id, name) = path.into_inner();
    let body = match signal_body(&state, &req, payload, &name).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let signal_id = body.id.clone();
    if let Err(refused) = own_job(&state, who, &id).await {
        return refused;
    }
    match state
        .store
        .waits().signal(&id, &name, &body)
        .await
    {
        Ok(SignalOutcome::Created(view)) => HttpResponse::Accepted().json(view),
        Ok(SignalOutcome::Existing(view)) => HttpResponse::Ok().json(view),
        Ok(SignalOutcome::Conflict) => error(Code::SignalConflict,
            format!("signal {signal_id:?} of {name:?} was recorded with another payload; the stored one is unchanged"),
            Some("payload"),
        ),
        Ok(SignalOutcome::Finished) => error(Code::JobFinished,
            format!("job {id:?} has finished; nothing waits for a signal any more"),
            None,
        ),
        Ok(SignalOutcome::NotWaiting) => error(Code::NotWaiting,
            format!("job {id:?} is not waiting for {name:?} due at that `until`: that wait is over (or not reached); nothing was recorded"),
            Some("until"),
        ),
        Ok(SignalOutcome::Decided) => error(Code::WaitDecided,
            format!("the wait of job {id:?} for {name:?} due at that `until` has its decision already; nothing was recorded"),
            Some("until"),
        ),
        Ok(SignalOutcome::TooMany) => error(Code::TooManySignals,
            format!(
                "job {id:?} holds {} untaken signals (or {} bytes of them), as many as it may; nothing was recorded",
                crate::store::waits::MAX_UNTAKEN_SIGNALS,
                crate::store::waits::MAX_UNTAKEN_SIGNAL_BYTES
            ),
            None,
        ),
        Ok(SignalOutcome::NotFound) => error(Code::NotFound,
            format!("no job {id:?}"),
            None,
        ),
        Err(e) => unavailable(e),
    }
}
