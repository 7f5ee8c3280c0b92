//! `/v1/schedules`: crons that create jobs (see [`crate::rules::schedule`] and
//! [`crate::store::schedules`]). A schedule belongs to the token that
//! created it, as a job does; another token's is a `404`.

use super::*;
use crate::error::InvalidInput;
use crate::rules::schedule::{CatchUp, Timetable};
use crate::store::schedules::{NewSchedule, ScheduleIntake};

/// Longest cron a schedule may have.
pub const MAX_CRON_LEN: usize = 200;

/// Schedules one token (not admin) may have.
pub const MAX_SCHEDULES_PER_TOKEN: i64 = 100;

/// Schedules a page of `GET /v1/schedules` shows at most (and by default).
const SCHEDULE_PAGE: i64 = 1000;

fn invalid(e: InvalidInput) -> HttpResponse {
    error(Code::Invalid, e.to_string(), Some(&e.field))
}

/// Validates a `POST /v1/schedules` body: the schedule's own fields here,
/// and `workflow`, `input` and `webhook_url` as intake validates a job's.
fn parse_schedule(state: &ApiState, body: &[u8]) -> Result<(NewSchedule, Timetable), IntakeError> {
    let serde_json::Value::Object(mut obj) = crate::node::intake::parse_json(body)? else {
        return Err(InvalidInput::new("body", "must be a JSON object").into());
    };
    let mut text = |field: &str, required: bool| -> Result<Option<String>, InvalidInput> {
        match obj.remove(field) {
            Some(serde_json::Value::String(s)) => Ok(Some(s)),
            // `null` for an optional field is its absence, as documented.
            Some(serde_json::Value::Null) if !required => Ok(None),
            Some(_) => Err(InvalidInput::new(field, "must be a string")),
            None if required => Err(InvalidInput::new(field, "is required")),
            None => Ok(None),
        }
    };
    let id = text("id", true)?.unwrap_or_default();
    crate::rules::schedule::validate_id(&id)?;
    let cron = text("cron", true)?.unwrap_or_default();
    if cron.len() > MAX_CRON_LEN {
        return Err(InvalidInput::new("cron", format!("at most {MAX_CRON_LEN} characters")).into());
    }
    let timezone = text("timezone", false)?.unwrap_or_else(|| "UTC".to_owned());
    let catch_up = match text("catch_up", false)? {
        None => CatchUp::Latest,
        Some(c) => CatchUp::parse(&c).ok_or_else(|| {
            InvalidInput::new("catch_up", "must be \"latest\", \"all\" or \"none\"")
        })?,
    };
    let table = Timetable::parse(&cron, &timezone)?;
    // The rest is a job's, checked by intake (as the first job would be).
    let job_fields = ["workflow", "input", "webhook_url"];
    if let Some(extra) = obj.keys().find(|k| !job_fields.contains(&k.as_str())) {
        return Err(InvalidInput::new(extra.clone(), "unknown field").into());
    }
    // (A placeholder id: the jobs' own ids are the schedules' to make.)
    obj.insert(
        "id".into(),
        serde_json::Value::String("schedule-check".into()),
    );
    let job_body = serde_json::to_vec(&obj).expect("a JSON object serialises");
    let job = crate::node::intake::parse(&job_body, &state.registry, &state.url_guard)?;
    Ok((
        NewSchedule {
            id,
            cron,
            timezone,
            workflow: job.workflow,
            input: job.input,
            webhook_url: job.webhook_url,
            catch_up,
        },
        table,
    ))
}

/// `POST /v1/schedules` `{"id", "cron", "timezone"?, "workflow", "input",
/// "webhook_url", "catch_up"?}`: `201` created · `200` the same schedule
/// again · `409 schedule_conflict` the id with another body · `422` a bad
/// field, named.
#[utoipa::path(post, path = "/v1/schedules", tag = "schedules", request_body = CreateSchedule,
    responses(
        (status = 201, body = ScheduleView),
        (status = 200, description = "The identical schedule again", body = ScheduleView),
        (status = 401, body = ErrorBody),
        (status = 409, description = "`schedule_conflict`, or `too_many_schedules`", body = ErrorBody),
        (status = 422, body = ErrorBody),
    ))]
pub(super) async fn create_schedule(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> HttpResponse {
    if !is_json(&req) {
        return not_json();
    }
    let limit = state.body_limit;
    let body = match read_body(&state, payload, limit, || {
        error(
            Code::TooLarge,
            format!("the request body exceeds {limit} bytes"),
            None,
        )
    })
    .await
    {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let (schedule, table) = match parse_schedule(&state, &body) {
        Ok(parsed) => parsed,
        Err(IntakeError::Invalid(e)) => return invalid(e),
        Err(IntakeError::Malformed(m)) => return error(Code::MalformedJson, m, None),
    };
    if who.scope().is_some() {
        // A tenant's bounds: how often its schedule fires, and how many.
        // (An admin token, and development mode without tokens, may ask for less.)
        let shortest = state.limits.min_schedule_interval;
        if let Some(gap) = table.shortest_gap(chrono::Utc::now(), 20) {
            if gap.to_std().unwrap_or_default() < shortest {
                return invalid(InvalidInput::new(
                    "cron",
                    format!(
                        "fires every {} s; a token's schedule fires at most once every {} s",
                        gap.num_seconds(),
                        shortest.as_secs()
                    ),
                ));
            }
        }
    }
    // A tenant's schedules are capped; the store counts them under a lock
    // per token, so concurrent creates on any nodes stop at the cap.
    let cap = who.scope().map(|_| MAX_SCHEDULES_PER_TOKEN);
    match state
        .store
        .schedules()
        .create(&schedule, &table, who.owner(), cap)
        .await
    {
        Ok(ScheduleIntake::TooMany(n)) => error(
            Code::TooManySchedules,
            format!("this token has {n} schedules, as many as it may; delete one first"),
            None,
        ),
        Ok(ScheduleIntake::Created(view)) => HttpResponse::Created().json(view),
        Ok(ScheduleIntake::Existing(view)) => HttpResponse::Ok().json(view),
        Ok(ScheduleIntake::Conflict) => error(
            Code::ScheduleConflict,
            format!(
                "schedule {:?} exists with another body; the stored one is unchanged",
                schedule.id
            ),
            Some("id"),
        ),
        Err(e) => unavailable(e),
    }
}

/// The query of `GET /v1/schedules`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleQuery {
    cursor: Option<String>,
    limit: Option<String>,
}

/// `GET /v1/schedules?cursor=&limit=`: the caller's schedules (an admin's:
/// all), by id, a page at a time (`next_cursor`).
#[utoipa::path(get, path = "/v1/schedules", tag = "schedules",
    params(
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 1000, description = "1–1000, default 1000"),
        ("cursor" = Option<String>, Query, description = "`next_cursor` of the page before"),
    ),
    responses(
        (status = 200, body = SchedulePage),
        (status = 401, body = ErrorBody),
        (status = 422, description = "A bad parameter (named)", body = ErrorBody),
    ))]
pub(super) async fn list_schedules(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    req: HttpRequest,
) -> HttpResponse {
    let query = match web::Query::<ScheduleQuery>::from_query(req.query_string()) {
        Ok(q) => q.into_inner(),
        Err(e) => return bad_query(&e),
    };
    let limit = match query.limit.as_deref().map(str::parse::<i64>) {
        None => SCHEDULE_PAGE,
        Some(Ok(n)) if (1..=SCHEDULE_PAGE).contains(&n) => n,
        Some(_) => {
            return invalid(InvalidInput::new(
                "limit",
                format!("must be an integer from 1 to {SCHEDULE_PAGE}"),
            ))
        }
    };
    let scope = who.scope();
    match state
        .store
        .schedules()
        .list(scope.is_none(), scope, query.cursor.as_deref(), limit)
        .await
    {
        Ok(list) => {
            let next = (list.len() as i64 == limit)
                .then(|| list.last().map(|s| s.id.clone()))
                .flatten();
            HttpResponse::Ok().json(serde_json::json!({ "schedules": list, "next_cursor": next }))
        }
        Err(e) => unavailable(e),
    }
}

/// Schedule `id` when the caller may see it; `404` otherwise.
async fn own_schedule(
    state: &ApiState,
    who: Who,
    id: &str,
) -> Result<crate::store::schedules::ScheduleDetail, HttpResponse> {
    match state.store.schedules().get(id).await {
        Ok(Some(s)) if who.sees(s.schedule.owner_token) => Ok(s),
        Ok(_) => Err(error(Code::NotFound, format!("no schedule {id:?}"), None)),
        Err(e) => Err(unavailable(e)),
    }
}

/// `GET /v1/schedules/{id}`: the schedule, its `next_fire_at` and its
/// latest jobs · `404`.
#[utoipa::path(get, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = String, Path)),
    responses((status = 200, body = ScheduleDetail), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_schedule(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> HttpResponse {
    match own_schedule(&state, who, &id).await {
        Ok(s) => HttpResponse::Ok().json(s),
        Err(refused) => refused,
    }
}

/// `DELETE /v1/schedules/{id}`: `204`, and nothing fires after · `404`.
/// Its jobs stay.
#[utoipa::path(delete, path = "/v1/schedules/{id}", tag = "schedules",
    params(("id" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn delete_schedule(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> HttpResponse {
    match state.store.schedules().delete(&id, who.scope()).await {
        Ok(true) => HttpResponse::NoContent().finish(),
        Ok(false) => error(
            Code::NotFound,
            format!("no schedule {:?}", id.as_str()),
            None,
        ),
        Err(e) => unavailable(e),
    }
}

/// `POST /v1/schedules/{id}/pause`: `200` and the schedule; nothing fires
/// until it is resumed · `404`.
#[utoipa::path(post, path = "/v1/schedules/{id}/pause", tag = "schedules",
    params(("id" = String, Path)),
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn pause_schedule(
    writer: Writer,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> HttpResponse {
    set_paused(writer, state, id, true).await
}

/// `POST /v1/schedules/{id}/resume`: `200` and the schedule, next firing
/// at its next fire time from now (those passed while it was paused never
/// fire) · `404`.
#[utoipa::path(post, path = "/v1/schedules/{id}/resume", tag = "schedules",
    params(("id" = String, Path)),
    responses((status = 200, body = ScheduleView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn resume_schedule(
    writer: Writer,
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> HttpResponse {
    set_paused(writer, state, id, false).await
}

async fn set_paused(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    id: web::Path<String>,
    paused: bool,
) -> HttpResponse {
    match state
        .store
        .schedules()
        .set_paused(&id, who.scope(), paused)
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            return error(
                Code::NotFound,
                format!("no schedule {:?}", id.as_str()),
                None,
            )
        }
        Err(e) => return unavailable(e),
    }
    match own_schedule(&state, who, &id).await {
        Ok(s) => HttpResponse::Ok().json(s),
        Err(refused) => refused,
    }
}
