//! `GET /v1/jobs/{id}/events`: a job's events as Server-Sent Events, resumable
//! with `Last-Event-ID`.

use super::*;

/// `GET /v1/jobs/{id}/events`: the job's events as server-sent events —
/// the chunks of its streamed answers (`chunk`), a restarted stream's
/// `reset`, a streamed agent's tool calls (`tool`), and its state changes
/// (`state`) — each with the `id` of one
/// increasing sequence per job. Only journaled (durable) events are sent,
/// so what a watcher saw is always a prefix of the journal. `Last-Event-ID`
/// resumes after that event; the stream ends after the job's final state,
/// and a resume past a finished job's last event is `204 No Content`.
/// A generated client's plain request would wait for the whole stream:
/// follow it with an EventSource client (npm `eventsource`, Python
/// `httpx-sse`), as onceflow's Python and TypeScript clients do.
#[utoipa::path(get, path = "/v1/jobs/{id}/events", tag = "jobs",
    params(
        ("id" = String, Path, description = "The job id"),
        ("Last-Event-ID" = Option<String>, Header, nullable = false, pattern = "^[0-9]{1,18}$", description = "Resume after this event (its id)"),
    ),
    responses(
        (status = 200, description = "Server-sent events (`text/event-stream`), each an `SseEvent` (`id:`, `event:` `state`, `chunk`, `reset` or `tool`, `data:` a JSON object); ends after the final state. Read it with an SSE client, which resumes with `Last-Event-ID`; a client that reads the whole body gets its text", content_type = "text/event-stream", body = SseEvent),
        (status = 204, description = "Resumed past the end of a finished job: nothing more will come"),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 429, description = "Too many open streams", body = ErrorBody),
    ))]
pub(super) async fn job_events(
    Reader(who): Reader,
    state: web::Data<ApiState>,
    req: HttpRequest,
    OwnJob(job): OwnJob,
) -> Answer {
    let after = match req.headers().get("last-event-id") {
        None => 0,
        Some(v) => match v.to_str().ok().and_then(|v| v.trim().parse::<i64>().ok()) {
            Some(n) if n >= 0 => n,
            _ => {
                return Err(error(Code::InvalidHeader,
                    "Last-Event-ID must be the id of an event this stream sent (a non-negative integer)",
                    Some("Last-Event-ID"),
                ))
            }
        },
    };
    let id = job.id;
    if finished_before(&state.store, &id, after).await {
        // Nothing more will come: 204 tells an EventSource to stop
        // reconnecting (a 200 that ends at once makes it come back).
        return Ok(HttpResponse::NoContent().finish());
    }
    let slot = state
        .limits
        .open_stream(who.owner())
        .map_err(|message| ApiError::new(Code::TooManyStreams, message).retry_after(5))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<web::Bytes>(64);
    let (store, hub) = (state.store.clone(), state.hub.clone());
    let token = who.owner();
    actix_web::rt::spawn(async move {
        let _slot = slot; // held until the stream ends
                          // Transitions of a followed job are announced (NOTIFY) by the
                          // database; without the row the stream still works, polling.
        let followed = match store.events().follow(&id).await {
            Ok(row) => Some(row),
            Err(e) => {
                tracing::warn!(error = %e, job.id = id, "cannot record a stream; it polls instead");
                None
            }
        };
        follow_events(&store, &hub, id, after, token, followed.is_some(), tx).await;
        if let Some(row) = followed {
            if let Err(e) = store.events().unfollow(row).await {
                tracing::warn!(error = %e, "cannot remove a closed stream's row; the purge will");
            }
        }
    });
    let body = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|b| b.map(Ok::<_, actix_web::Error>))
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body))
}

// What the stream writes (`frame`) and the schema of each event in the
// document.
/// One server-sent event of `GET /v1/jobs/{id}/events`.
#[derive(Debug, utoipa::ToSchema)]
pub(super) struct SseEvent {
    /// Its place in the job's one increasing sequence (`Last-Event-ID`).
    #[schema(pattern = "^[0-9]+$")]
    id: String,
    /// `state`, `chunk`, `reset` or `tool`.
    #[schema(pattern = "^(state|chunk|reset|tool)$")]
    event: String,
    /// A JSON object: `{"id", "kind", "text", "at"}`; for a chunk also its
    /// `call`, `generation` and `offset`; for a tool event its `call` and
    /// `tool` (`{"phase", "name", "tool_call_id"}`).
    #[schema(content_media_type = "application/json")]
    data: String,
}

impl SseEvent {
    fn of(event: &crate::store::streams::JobEvent) -> Self {
        SseEvent {
            id: event.id.to_string(),
            event: event.kind.to_string(),
            data: serde_json::to_string(event).expect("an event serialises"),
        }
    }

    /// The event as the stream sends it.
    fn frame(&self) -> web::Bytes {
        web::Bytes::from(format!(
            "id: {}\nevent: {}\ndata: {}\n\n",
            self.id, self.event, self.data
        ))
    }
}

/// Whether job `id` has finished and journaled no event after `after`
/// (a resume past a finished job's last event). The state is read first:
/// a job that finishes between the two reads has its final event journaled
/// with the move, so the second read sees it and the stream sends it. A
/// read error is `false`: the stream then finds out itself. (A dead job
/// may be redriven later; its new events are read by a new request.)
async fn finished_before(store: &Store, id: &str, after: i64) -> bool {
    if after == 0 {
        return false; // a first connection gets the whole journal
    }
    if !matches!(store.jobs().get(id).await, Ok(Some(view)) if view.state.is_terminal()) {
        return false;
    }
    matches!(store.events().of_job(id, after, 1).await, Ok(events) if events.is_empty())
}

/// Sends `job_id`'s events after `after` to `tx` as they are journaled,
/// until the job's final state has been sent, the watcher leaves, or its
/// token is revoked. Chunks written on this node arrive as committed and
/// are sent without reading them back when they follow the last event
/// sent; anything else (another node's chunks, state changes, a gap) is
/// read from the journal when a `NOTIFY` says the job moved. An idle stream
/// reads nothing: it sends a keep-alive comment every 15 s and reads again
/// once a minute as a safety net (a `NOTIFY` lost while the node's `LISTEN`
/// reconnected), checking its token then; a revocation announced by
/// `NOTIFY` ends the token's streams at once. Without the `followed` row
/// (`Events::follow` failed) it reads every second.
pub(super) async fn follow_events(
    store: &Store,
    hub: &crate::hub::Hub,
    job_id: String,
    mut after: i64,
    token: Option<i64>,
    followed: bool,
    tx: tokio::sync::mpsc::Sender<web::Bytes>,
) {
    use tokio::sync::broadcast::error::RecvError;
    const KEEP_ALIVE: Duration = Duration::from_secs(15);
    let safety = if followed {
        Duration::from_secs(60)
    } else {
        Duration::from_secs(1)
    };
    let frame = |event: &crate::store::streams::JobEvent| SseEvent::of(event).frame();
    // Subscribed before the first read, so a commit in between is not missed.
    let mut moved = hub.watch(&job_id);
    let mut revocations = hub.token_changes();
    loop {
        let events = match store.events().of_job(&job_id, after, 500).await {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(error = %e, job.id = job_id, "reading a job's events");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut finished = false;
        for event in &events {
            after = event.id;
            finished = event.kind == "state"
                && event
                    .text
                    .parse::<crate::JobState>()
                    .is_ok_and(|s| s.is_terminal());
            if tx.send(frame(event)).await.is_err() {
                return; // the watcher left
            }
        }
        if finished {
            return;
        }
        if events.len() == 500 {
            continue; // more to read
        }
        if events.is_empty() {
            // Resumed past the end of a finished job: nothing more will come.
            if let Ok(Some(view)) = store.jobs().get(&job_id).await {
                if view.state.is_terminal() {
                    return;
                }
            }
        }
        // Chunks come as they commit, other moves as announced.
        let read_at = std::time::Instant::now();
        loop {
            let wait = KEEP_ALIVE.min(safety.saturating_sub(read_at.elapsed()));
            tokio::select! {
                published = moved.recv() => match published {
                    Ok(p) if p.prev == Some(after) && !p.events.is_empty() => {
                        for event in &p.events {
                            after = event.id;
                            if tx.send(frame(event)).await.is_err() {
                                return;
                            }
                        }
                    }
                    // Announced, and seen already (this node's own write).
                    Ok(p) if p.upto.is_some_and(|upto| upto <= after) => {}
                    Ok(_) | Err(RecvError::Lagged(_)) => break,
                    Err(RecvError::Closed) => {
                        moved = hub.watch(&job_id);
                        break;
                    }
                },
                _ = tokio::time::sleep(wait) => {
                    if read_at.elapsed() >= safety {
                        // A revoked token's stream ends.
                        if let Some(token) = token {
                            if matches!(store.tokens().live(token).await, Ok(false)) {
                                return;
                            }
                        }
                        break;
                    }
                    if tx
                        .send(web::Bytes::from_static(b": keep-alive\n\n"))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                // A revoked token's stream ends at once (announced by NOTIFY).
                revoked = revocations.recv(), if token.is_some() => match revoked {
                    Ok(id) if Some(id) != token => {}
                    Err(RecvError::Closed) => revocations = hub.token_changes(),
                    Ok(_) | Err(RecvError::Lagged(_)) => {
                        if let Some(token) = token {
                            if matches!(store.tokens().live(token).await, Ok(false)) {
                                return;
                            }
                        }
                    }
                },
                _ = tx.closed() => return,
            }
        }
    }
}
