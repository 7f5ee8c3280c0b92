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

/// `POST /v1/schedules`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateSchedule {
    /// 1–150 characters of `A-Z a-z 0-9 _ . -`.
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,150}$")]
    id: String,
    /// Five fields, or six with seconds first.
    #[schema(min_length = 9)]
    cron: String,
    /// An IANA time zone (default UTC).
    timezone: Option<String>,
    /// The workflow each firing's job runs.
    workflow: String,
    /// Each job's input, checked by the workflow as a submit's is.
    #[schema(value_type = Object)]
    input: serde_json::Value,
    /// Each job's webhook; none: the jobs POST nothing.
    #[schema(format = "uri", pattern = "^https?://")]
    webhook_url: Option<String>,
    /// `latest` (default), `all` or `none`.
    #[schema(pattern = "^(latest|all|none)$")]
    catch_up: Option<String>,
}

impl extract::Body for CreateSchedule {
    fn limit(state: &ApiState) -> usize {
        state.body_limit
    }
}

/// Validates a `POST /v1/schedules` body: the schedule's own fields here,
/// and `workflow`, `input` and `webhook_url` as intake validates a job's.
fn parse_schedule(
    state: &ApiState,
    body: CreateSchedule,
) -> Result<(NewSchedule, Timetable), InvalidInput> {
    crate::rules::schedule::validate_id(&body.id)?;
    if body.cron.len() > MAX_CRON_LEN {
        return Err(InvalidInput::new(
            "cron",
            format!("at most {MAX_CRON_LEN} characters"),
        ));
    }
    let timezone = body.timezone.unwrap_or_else(|| "UTC".to_owned());
    let catch_up = match body.catch_up {
        None => CatchUp::Latest,
        Some(c) => CatchUp::parse(&c).ok_or_else(|| {
            InvalidInput::new("catch_up", "must be \"latest\", \"all\" or \"none\"")
        })?,
    };
    let table = Timetable::parse(&body.cron, &timezone)?;
    // The rest is a job's, checked by intake (as the first job would be;
    // a placeholder id: the jobs' own ids are the schedule's to make).
    let job = crate::node::intake::validate(
        crate::node::intake::SubmitJob {
            id: "schedule-check".into(),
            workflow: body.workflow,
            input: body.input,
            webhook_url: body.webhook_url,
            ..Default::default()
        },
        &state.registry,
        &state.url_guard,
    )?;
    Ok((
        NewSchedule {
            id: body.id,
            cron: body.cron,
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
    Json(body, _held): Json<CreateSchedule>,
) -> Answer {
    let (schedule, table) = parse_schedule(&state, body)?;
    if who.scope().is_some() {
        // A tenant's bounds: how often its schedule fires, and how many.
        // (An admin token, and development mode without tokens, may ask for less.)
        let shortest = state.limits.min_schedule_interval;
        if let Some(gap) = table.shortest_gap(chrono::Utc::now(), 20) {
            if gap.to_std().unwrap_or_default() < shortest {
                return Err(InvalidInput::new(
                    "cron",
                    format!(
                        "fires every {} s; a token's schedule fires at most once every {} s",
                        gap.num_seconds(),
                        shortest.as_secs()
                    ),
                )
                .into());
            }
        }
    }
    // A tenant's schedules are capped; the store counts them under a lock
    // per token, so concurrent creates on any nodes stop at the cap.
    let cap = who.scope().map(|_| MAX_SCHEDULES_PER_TOKEN);
    let created = state
        .store
        .schedules()
        .create(&schedule, &table, who.owner(), cap)
        .await
        .map_err(unavailable)?;
    Err(match created {
        ScheduleIntake::Created(view) => return Ok(HttpResponse::Created().json(view)),
        ScheduleIntake::Existing(view) => return Ok(HttpResponse::Ok().json(view)),
        ScheduleIntake::TooMany(n) => error(
            Code::TooManySchedules,
            format!("this token has {n} schedules, as many as it may; delete one first"),
            None,
        ),
        ScheduleIntake::Conflict => error(
            Code::ScheduleConflict,
            format!(
                "schedule {:?} exists with another body; the stored one is unchanged",
                schedule.id
            ),
            Some("id"),
        ),
    })
}

/// The query of `GET /v1/schedules`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ScheduleQuery {
    /// `next_cursor` of the page before.
    cursor: Option<String>,
    /// 1–1000, default 1000.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

/// A page of `GET /v1/schedules`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct SchedulePage {
    schedules: Vec<ScheduleView>,
    /// The `cursor` of the next page; `null` on the last.
    next_cursor: Option<String>,
}

/// `GET /v1/schedules?cursor=&limit=`: the caller's schedules (an admin's:
/// all), by id, a page at a time (`next_cursor`).
#[utoipa::path(get, path = "/v1/schedules", tag = "schedules",
    params(ScheduleQuery),
    responses(
        (status = 200, body = SchedulePage),
        (status = 401, body = ErrorBody),
        (status = 422, description = "A bad parameter (named)", body = ErrorBody),
    ))]
pub(super) async fn list_schedules(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    Query(query): Query<ScheduleQuery>,
) -> Answer {
    let limit = match query.limit.as_deref().map(str::parse::<i64>) {
        None => SCHEDULE_PAGE,
        Some(Ok(n)) if (1..=SCHEDULE_PAGE).contains(&n) => n,
        Some(_) => {
            return Err(InvalidInput::new(
                "limit",
                format!("must be an integer from 1 to {SCHEDULE_PAGE}"),
            )
            .into())
        }
    };
    let scope = who.scope();
    let schedules = state
        .store
        .schedules()
        .list(scope.is_none(), scope, query.cursor.as_deref(), limit)
        .await
        .map_err(unavailable)?;
    let next_cursor = (schedules.len() as i64 == limit)
        .then(|| schedules.last().map(|s| s.id.clone()))
        .flatten();
    Ok(HttpResponse::Ok().json(SchedulePage {
        schedules,
        next_cursor,
    }))
}

/// Schedule `id` when the caller may see it; `404` otherwise.
async fn own_schedule(
    state: &ApiState,
    who: Who,
    id: &str,
) -> Result<crate::store::schedules::ScheduleDetail, ApiError> {
    match state.store.schedules().get(id).await.map_err(unavailable)? {
        Some(s) if who.sees(s.schedule.owner_token) => Ok(s),
        _ => Err(error(Code::NotFound, format!("no schedule {id:?}"), None)),
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
) -> Answer {
    Ok(HttpResponse::Ok().json(own_schedule(&state, who, &id).await?))
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
) -> Answer {
    if !state
        .store
        .schedules()
        .delete(&id, who.scope())
        .await
        .map_err(unavailable)?
    {
        return Err(error(
            Code::NotFound,
            format!("no schedule {:?}", id.as_str()),
            None,
        ));
    }
    Ok(HttpResponse::NoContent().finish())
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
) -> Answer {
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
) -> Answer {
    set_paused(writer, state, id, false).await
}

async fn set_paused(
    Writer(who): Writer,
    state: web::Data<ApiState>,
    id: web::Path<String>,
    paused: bool,
) -> Answer {
    if !state
        .store
        .schedules()
        .set_paused(&id, who.scope(), paused)
        .await
        .map_err(unavailable)?
    {
        return Err(error(
            Code::NotFound,
            format!("no schedule {:?}", id.as_str()),
            None,
        ));
    }
    Ok(HttpResponse::Ok().json(own_schedule(&state, who, &id).await?))
}
