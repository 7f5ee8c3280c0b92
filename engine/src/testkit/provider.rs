//! A fake provider. On `/v1/chat/completions` it speaks OpenAI's format and
//! honours `Idempotency-Key` the way a careful real one does: the first
//! request under a key does the work; a repeat returns the stored response
//! without doing it again (and waits for a request still in progress under
//! that key). On `/v1/messages` it speaks Anthropic's Messages API, which does
//! not de-duplicate: every request does the work, counted under its key.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Value};

use super::server::{self, Behaviour, Script};

/// One request the provider received.
#[derive(Debug, Clone)]
pub struct ProviderRequest {
    /// The `Idempotency-Key` header, if sent.
    pub idempotency_key: Option<String>,
    /// The request body.
    pub body: Value,
    /// The `traceparent` header, if sent.
    pub traceparent: Option<String>,
    /// The `Authorization` header, if sent.
    pub authorization: Option<String>,
    /// `HTTP/1.1` or `HTTP/2.0`.
    pub http_version: String,
    /// The path asked (`/v1/chat/completions` or `/v1/messages`).
    pub path: String,
    /// The `x-api-key` header (Anthropic), if sent.
    pub x_api_key: Option<String>,
    /// The `anthropic-version` header, if sent.
    pub anthropic_version: Option<String>,
    /// When it arrived.
    pub received_at: std::time::Instant,
    /// Answered 429 because too many calls were in flight ([`FakeProvider::set_max_concurrent`]).
    pub throttled: bool,
    /// When its answer was done (`None`: still being answered, or throttled).
    pub answered_at: Option<std::time::Instant>,
}

/// Builds the response for a request; gets the request and the work number.
pub type Responder = dyn Fn(&Value, u64) -> Value + Send + Sync;

#[derive(Default)]
struct State {
    requests: Mutex<Vec<ProviderRequest>>,
    /// Work done per key: the count, and the response once finished.
    work: Mutex<HashMap<String, (u32, Option<Value>)>>,
    work_total: Mutex<u64>,
    script: Script,
    latency: Mutex<Duration>,
    responder: Mutex<Option<Arc<Responder>>>,
    anthropic_responder: Mutex<Option<Arc<Responder>>>,
    /// Calls being answered now, and the most allowed (429 above it).
    in_flight: Mutex<(usize, Option<usize>)>,
    /// The most calls answered at once.
    peak: Mutex<usize>,
    /// The most calls accepted within a sliding window (429 above it).
    rate: Mutex<Option<(usize, Duration)>>,
    /// Streams: the answer streamed under each key, and how they go.
    streams: Mutex<Streams>,
}

/// How the fake streams (`"stream": true`).
#[derive(Debug)]
struct Streams {
    /// The deltas streamed under each key (text pieces, tool-call pieces).
    answers: HashMap<String, Vec<Value>>,
    /// A repeated request replays the key's answer (no new work), as a
    /// provider that de-duplicates by `Idempotency-Key` does; otherwise
    /// it generates (and is paid for) a new one.
    replay: bool,
    /// Chunks per answer.
    words: usize,
    /// Time between chunks.
    interval: Duration,
    /// Each gap drawn uniformly from 0.5–1.5 × `interval` (a model's pace
    /// is irregular; streams started together then drift apart).
    jitter: bool,
    /// How the next streams go, in turn: dropped after so many chunks, or
    /// (`None`) whole.
    drops: std::collections::VecDeque<Option<usize>>,
    /// Stream requests received, and chunks sent.
    requests: usize,
    chunks: usize,
    /// When each chunk was written out (key, index), for benchmarks.
    sent_at: Vec<(String, usize, std::time::Instant)>,
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            answers: HashMap::new(),
            replay: true,
            words: 8,
            interval: Duration::from_millis(5),
            jitter: false,
            drops: Default::default(),
            requests: 0,
            chunks: 0,
            sent_at: Vec::new(),
        }
    }
}

/// The fake provider. Cheap to clone.
#[derive(Clone)]
pub struct FakeProvider {
    addr: SocketAddr,
    state: Arc<State>,
}

impl std::fmt::Debug for FakeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FakeProvider({})", self.addr)
    }
}

impl FakeProvider {
    /// Starts the provider on a loopback port, in a thread of its own.
    pub fn start() -> Self {
        let state = Arc::new(State::default());
        let data = web::Data::from(state.clone());
        let addr = server::spawn("fake-provider", move |cfg| {
            cfg.app_data(data.clone())
                .route("/v1/chat/completions", web::post().to(chat))
                .route("/v1/messages", web::post().to(messages));
        });
        FakeProvider { addr, state }
    }

    /// The base URL to configure as `OPENAI_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Scripts the next request.
    pub fn push(&self, b: Behaviour) {
        self.state.script.push(b);
    }

    /// Latency added to every request that does work.
    pub fn set_latency(&self, d: Duration) {
        *self.state.latency.lock().expect("lock") = d;
    }

    /// Replaces the default echo response.
    pub fn respond_with(&self, f: impl Fn(&Value, u64) -> Value + Send + Sync + 'static) {
        *self.state.responder.lock().expect("lock") = Some(Arc::new(f));
    }

    /// Answers 429 to a call that arrives while `max` calls are being
    /// answered, as a provider's concurrency limit does.
    pub fn set_max_concurrent(&self, max: usize) {
        self.state.in_flight.lock().expect("lock").1 = Some(max);
    }

    /// Answers 429 to a call that arrives when `max` calls were already
    /// accepted within the last `window`, as a provider's rate limit does
    /// (each accepted call reports 10 tokens of usage, so `max` calls is
    /// also `10 × max` tokens per window).
    pub fn set_rate_limit(&self, max: usize, window: Duration) {
        *self.state.rate.lock().expect("lock") = Some((max, window));
    }

    /// The most calls accepted within any `window` (sliding, from their
    /// arrival times).
    pub fn peak_rate(&self, window: Duration) -> usize {
        let accepted: Vec<std::time::Instant> = self
            .requests()
            .iter()
            .filter(|r| !r.throttled)
            .map(|r| r.received_at)
            .collect();
        (0..accepted.len())
            .map(|i| {
                accepted[i..]
                    .iter()
                    .take_while(|t| t.duration_since(accepted[i]) < window)
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether a repeated streamed request under a key replays that key's
    /// answer (default) or generates a new one.
    pub fn set_stream_replay(&self, replay: bool) {
        self.state.streams.lock().expect("lock").replay = replay;
    }

    /// Chunks per streamed answer (default 8) and the time between them.
    pub fn set_stream_shape(&self, words: usize, interval: Duration) {
        let mut s = self.state.streams.lock().expect("lock");
        s.words = words;
        s.interval = interval;
    }

    /// Draws each gap between chunks from 0.5–1.5 × the interval.
    pub fn set_stream_jitter(&self, jitter: bool) {
        self.state.streams.lock().expect("lock").jitter = jitter;
    }

    /// The next streamed answer drops the connection after `chunks` chunks.
    pub fn drop_stream_after(&self, chunks: usize) {
        self.state
            .streams
            .lock()
            .expect("lock")
            .drops
            .push_back(Some(chunks));
    }

    /// The next streamed answer (after those already planned) goes whole:
    /// with [`drop_stream_after`](Self::drop_stream_after), plans which of
    /// several streams break.
    pub fn stream_whole(&self) {
        self.state
            .streams
            .lock()
            .expect("lock")
            .drops
            .push_back(None);
    }

    /// When each streamed chunk was handed to the connection: (key, its
    /// index in the answer, the instant).
    pub fn chunks_sent_at(&self) -> Vec<(String, usize, std::time::Instant)> {
        self.state.streams.lock().expect("lock").sent_at.clone()
    }

    /// Streamed requests received.
    pub fn stream_requests(&self) -> usize {
        self.state.streams.lock().expect("lock").requests
    }

    /// Chunks streamed, over every request.
    pub fn chunks_streamed(&self) -> usize {
        self.state.streams.lock().expect("lock").chunks
    }

    /// The text streamed under `key` (its latest answer).
    pub fn streamed_text(&self, key: &str) -> Option<String> {
        self.state
            .streams
            .lock()
            .expect("lock")
            .answers
            .get(key)
            .map(|deltas| {
                deltas
                    .iter()
                    .filter_map(|d| d["content"].as_str())
                    .collect()
            })
    }

    /// Requests answered 429 for being over the concurrency or rate limit.
    pub fn throttled(&self) -> usize {
        self.requests().iter().filter(|r| r.throttled).count()
    }

    /// The most calls answered at once within each group, where `group`
    /// names a request's group (`None`: counted in none). Calls still
    /// being answered count as open; throttled ones not at all.
    pub fn peak_concurrency_by(
        &self,
        group: impl Fn(&ProviderRequest) -> Option<String>,
    ) -> HashMap<String, usize> {
        let requests = self.state.requests.lock().expect("lock");
        let mut edges: HashMap<String, Vec<(std::time::Instant, i32)>> = HashMap::new();
        for r in requests.iter().filter(|r| !r.throttled) {
            if let Some(g) = group(r) {
                let e = edges.entry(g).or_default();
                e.push((r.received_at, 1));
                if let Some(end) = r.answered_at {
                    e.push((end, -1));
                }
            }
        }
        edges
            .into_iter()
            .map(|(g, mut e)| {
                // Ends before starts at the same instant: touching is not overlapping.
                e.sort();
                let (mut now, mut peak) = (0i32, 0i32);
                for (_, d) in e {
                    now += d;
                    peak = peak.max(now);
                }
                (g, peak as usize)
            })
            .collect()
    }

    /// The most calls it answered at once.
    pub fn peak_concurrency(&self) -> usize {
        *self.state.peak.lock().expect("lock")
    }

    /// The base URL to configure as `ANTHROPIC_BASE_URL`.
    pub fn anthropic_base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the default echo of `/v1/messages` (an Anthropic response).
    pub fn respond_anthropic_with(&self, f: impl Fn(&Value, u64) -> Value + Send + Sync + 'static) {
        *self.state.anthropic_responder.lock().expect("lock") = Some(Arc::new(f));
    }

    /// Every request received, in order.
    pub fn requests(&self) -> Vec<ProviderRequest> {
        self.state.requests.lock().expect("lock").clone()
    }

    /// Requests received under `key`.
    pub fn requests_for(&self, key: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.idempotency_key.as_deref() == Some(key))
            .count()
    }

    /// How many times the work under `key` was actually done.
    pub fn work_done(&self, key: &str) -> u32 {
        self.state
            .work
            .lock()
            .expect("lock")
            .get(key)
            .map_or(0, |(n, _)| *n)
    }

    /// Work done under all keys.
    pub fn total_work(&self) -> u64 {
        *self.state.work_total.lock().expect("lock")
    }

    /// The keys whose work was done more than once.
    pub fn keys_worked_twice(&self) -> Vec<String> {
        let work = self.state.work.lock().expect("lock");
        work.iter()
            .filter(|(_, (n, _))| *n > 1)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

fn header(req: &HttpRequest, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn echo(request: &Value, n: u64) -> Value {
    let last = request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    json!({
        "id": format!("chatcmpl-{n}"),
        "object": "chat.completion",
        "model": request["model"],
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": format!("echo: {last} (#{n})") },
            "finish_reason": "stop"
        }],
        "usage": { "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10 }
    })
}

/// A call being answered (the state, and the request's place in the
/// record); counted out, and its end recorded, when dropped.
struct Answering(web::Data<State>, usize);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.in_flight.lock().expect("lock").0 -= 1;
        if let Some(r) = self.0.requests.lock().expect("lock").get_mut(self.1) {
            r.answered_at = Some(std::time::Instant::now());
        }
    }
}

/// Records the request and takes the scripted behaviour; a scripted status,
/// or a call over the concurrency limit, is answered at once.
fn receive(
    state: &web::Data<State>,
    req: &HttpRequest,
    body: &Value,
) -> (
    Option<String>,
    Behaviour,
    Option<HttpResponse>,
    Option<Answering>,
) {
    let key = header(req, "idempotency-key");
    state.requests.lock().expect("lock").push(ProviderRequest {
        idempotency_key: key.clone(),
        body: body.clone(),
        traceparent: header(req, "traceparent"),
        authorization: header(req, "authorization"),
        http_version: format!("{:?}", req.version()),
        path: req.path().to_owned(),
        x_api_key: header(req, "x-api-key"),
        anthropic_version: header(req, "anthropic-version"),
        received_at: std::time::Instant::now(),
        throttled: false,
        answered_at: None,
    });
    let place = state.requests.lock().expect("lock").len() - 1;
    let now = std::time::Instant::now();
    let over_rate = state
        .rate
        .lock()
        .expect("lock")
        .is_some_and(|(max, window)| {
            let requests = state.requests.lock().expect("lock");
            // Every request but the one just recorded.
            let before = &requests[..requests.len() - 1];
            before
                .iter()
                .rev()
                .take_while(|r| now.duration_since(r.received_at) < window)
                .filter(|r| !r.throttled)
                .count()
                >= max
        });
    let over = over_rate || {
        let mut in_flight = state.in_flight.lock().expect("lock");
        match in_flight.1 {
            Some(max) if in_flight.0 >= max => true,
            _ => {
                in_flight.0 += 1;
                let mut peak = state.peak.lock().expect("lock");
                *peak = (*peak).max(in_flight.0);
                false
            }
        }
    };
    if over {
        if let Some(r) = state.requests.lock().expect("lock").last_mut() {
            r.throttled = true;
        }
        let answer = HttpResponse::TooManyRequests()
            .json(json!({ "error": { "message": "rate or concurrency limit reached" } }));
        return (key, Behaviour::Ok, Some(answer), None);
    }
    let answering = Some(Answering(state.clone(), place));
    let behaviour = state.script.next();
    if let Behaviour::Status(code, retry_after) = behaviour {
        let mut r =
            HttpResponse::build(actix_web::http::StatusCode::from_u16(code).expect("status"));
        if let Some(s) = retry_after {
            r.insert_header(("retry-after", s.to_string()));
        }
        let answer = r.json(json!({ "error": { "message": format!("scripted {code}") } }));
        return (key, behaviour, Some(answer), answering);
    }
    (key, behaviour, None, answering)
}

/// Counts one unit of work, under `key` when given; returns its number.
fn count_work(state: &State, key: Option<&String>) -> u64 {
    let n = {
        let mut total = state.work_total.lock().expect("lock");
        *total += 1;
        *total
    };
    if let Some(key) = key {
        state
            .work
            .lock()
            .expect("lock")
            .entry(key.clone())
            .or_insert((0, None))
            .0 += 1;
    }
    n
}

/// Sleeps the configured latency plus a scripted `Slow`.
async fn take_time(state: &State, behaviour: &Behaviour) {
    let latency = *state.latency.lock().expect("lock");
    let extra = match behaviour {
        Behaviour::Slow(d) => *d,
        _ => Duration::ZERO,
    };
    if !(latency + extra).is_zero() {
        actix_web::rt::time::sleep(latency + extra).await;
    }
}

/// A streamed answer as OpenAI sends it: one `chat.completion.chunk` event
/// per delta, a last chunk with the finish reason, one with the usage
/// (`stream_options.include_usage`), then `data: [DONE]`. The answer is the
/// responder's (see [`FakeProvider::respond_with`]) cut into deltas — its
/// text by word, each tool call as a head then its arguments in two
/// pieces — or else numbered words. A repeated key replays its deltas (no
/// new work) unless replay is off; a scripted drop ends the connection
/// mid-answer, without `[DONE]`.
fn stream(state: &web::Data<State>, key: Option<String>, body: &Value) -> HttpResponse {
    let responder = state.responder.lock().expect("lock").clone();
    let (deltas, interval, jitter, drop_after) = plan_stream(state, key.as_ref(), true, |n| {
        responder.as_ref().map(|f| f(body, n))
    });
    let model = body["model"].clone();
    let chunk = |delta: &Value, finish: Value| {
        let event = json!({
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        format!("data: {event}\n\n")
    };
    // Each event, and whether it carries text (counted as a chunk streamed).
    let mut events: Vec<(String, bool)> = deltas
        .iter()
        .map(|d| (chunk(d, Value::Null), d.get("content").is_some()))
        .collect();
    let shown = drop_after.unwrap_or(usize::MAX).min(events.len());
    let complete = drop_after.is_none();
    if complete {
        let calls = deltas.iter().any(|d| d.get("tool_calls").is_some());
        let finish = if calls { "tool_calls" } else { "stop" };
        events.push((chunk(&json!({}), json!(finish)), false));
        let usage = json!({ "choices": [], "usage": {
            "prompt_tokens": 7, "completion_tokens": deltas.len(), "total_tokens": 7 + deltas.len()
        }});
        events.push((format!("data: {usage}\n\n"), false));
        events.push(("data: [DONE]\n\n".to_owned(), false));
    } else {
        events.truncate(shown);
    }
    send_stream(state, key, events, interval, jitter, complete)
}

/// The deltas of the next streamed answer under `key`, and how it goes:
/// a known key's deltas again when `replay` is allowed and on (no new
/// work), or else new work answered by `answer(n)` cut into deltas (see
/// [`deltas_of`]) or, without an answer, numbered words.
fn plan_stream(
    state: &web::Data<State>,
    key: Option<&String>,
    replay: bool,
    answer: impl FnOnce(u64) -> Option<Value>,
) -> (Vec<Value>, Duration, bool, Option<usize>) {
    let mut s = state.streams.lock().expect("lock");
    s.requests += 1;
    let known = key.and_then(|k| s.answers.get(k)).cloned();
    let deltas = match known.filter(|_| replay && s.replay) {
        Some(deltas) => deltas,
        None => {
            let n = count_work(state, key);
            let deltas = match answer(n) {
                Some(completion) => deltas_of(&completion),
                None => (0..s.words)
                    .map(|i| json!({ "content": format!("w{n}.{i} ") }))
                    .collect(),
            };
            if let Some(k) = key {
                s.answers.insert(k.clone(), deltas.clone());
            }
            deltas
        }
    };
    (deltas, s.interval, s.jitter, s.drops.pop_front().flatten())
}

/// A streamed answer as Anthropic's Messages API sends it (`event:` and
/// `data:` lines): `message_start`, a `ping`, the text as one block of
/// `text_delta`s, each tool call as a `tool_use` block whose input arrives
/// as `input_json_delta` pieces, then `message_delta` (stop reason, output
/// tokens) and `message_stop`. The same deltas as OpenAI's stream (the
/// answer of [`FakeProvider::respond_anthropic_with`], translated, or
/// numbered words), never replayed (Anthropic does not de-duplicate by
/// key); a scripted drop ends the connection after so many deltas.
fn stream_anthropic(state: &web::Data<State>, key: Option<String>, body: &Value) -> HttpResponse {
    let responder = state.anthropic_responder.lock().expect("lock").clone();
    let (deltas, interval, jitter, drop_after) = plan_stream(state, key.as_ref(), false, |n| {
        responder.as_ref().map(|f| {
            crate::net::provider::anthropic::response(&f(body, n)).expect("a Messages answer")
        })
    });
    let event = |data: Value| {
        let kind = data["type"].as_str().unwrap_or_default().to_owned();
        format!("event: {kind}\ndata: {data}\n\n")
    };
    let mut events: Vec<(String, bool)> = vec![
        (
            event(json!({ "type": "message_start", "message": {
                "id": "msg_fake", "type": "message", "role": "assistant", "content": [],
                "model": body["model"], "stop_reason": null,
                "usage": { "input_tokens": 7, "output_tokens": 1 } } })),
            false,
        ),
        (event(json!({ "type": "ping" })), false),
    ];
    // Block indexes: the text's (if any) first, then one per tool call.
    let has_text = deltas.iter().any(|d| d.get("content").is_some());
    let mut open: Option<u64> = None;
    for d in deltas.iter().take(drop_after.unwrap_or(usize::MAX)) {
        if let Some(text) = d["content"].as_str() {
            if open.is_none() {
                events.push((
                    event(json!({ "type": "content_block_start", "index": 0,
                    "content_block": { "type": "text", "text": "" } })),
                    false,
                ));
                open = Some(0);
            }
            events.push((
                event(json!({ "type": "content_block_delta", "index": 0,
                "delta": { "type": "text_delta", "text": text } })),
                true,
            ));
        } else {
            let piece = &d["tool_calls"][0];
            let index = piece["index"].as_u64().unwrap_or_default() + u64::from(has_text);
            if piece.get("id").is_some() {
                if let Some(i) = open {
                    events.push((
                        event(json!({ "type": "content_block_stop", "index": i })),
                        false,
                    ));
                }
                events.push((
                    event(json!({ "type": "content_block_start", "index": index,
                    "content_block": { "type": "tool_use", "id": piece["id"],
                        "name": piece["function"]["name"], "input": {} } })),
                    false,
                ));
                open = Some(index);
            } else {
                events.push((
                    event(json!({ "type": "content_block_delta", "index": index,
                    "delta": { "type": "input_json_delta",
                        "partial_json": piece["function"]["arguments"] } })),
                    false,
                ));
            }
        }
    }
    let complete = drop_after.is_none();
    if complete {
        if let Some(i) = open {
            events.push((
                event(json!({ "type": "content_block_stop", "index": i })),
                false,
            ));
        }
        let calls = deltas.iter().any(|d| d.get("tool_calls").is_some());
        let stop = if calls { "tool_use" } else { "end_turn" };
        events.push((
            event(json!({ "type": "message_delta",
            "delta": { "stop_reason": stop, "stop_sequence": null },
            "usage": { "output_tokens": deltas.len() } })),
            false,
        ));
        events.push((event(json!({ "type": "message_stop" })), false));
    }
    send_stream(state, key, events, interval, jitter, complete)
}

/// Sends `events` (each with whether it carries text, counted as a chunk
/// streamed) `interval` apart; an incomplete stream then drops the
/// connection.
fn send_stream(
    state: &web::Data<State>,
    key: Option<String>,
    events: Vec<(String, bool)>,
    interval: Duration,
    jitter: bool,
    complete: bool,
) -> HttpResponse {
    let state = state.clone();
    let key = key.unwrap_or_default();
    let body =
        futures_util::stream::unfold((events.into_iter(), 0usize), move |(mut events, sent)| {
            let state = state.clone();
            let key = key.clone();
            async move {
                match events.next() {
                    Some((e, text)) => {
                        if sent > 0 {
                            let gap = if jitter {
                                interval.mul_f64(rand::random_range(0.5..1.5))
                            } else {
                                interval
                            };
                            actix_web::rt::time::sleep(gap).await;
                        }
                        if text {
                            let mut s = state.streams.lock().expect("lock");
                            s.chunks += 1;
                            s.sent_at
                                .push((key.clone(), sent, std::time::Instant::now()));
                        }
                        Some((Ok(web::Bytes::from(e)), (events, sent + 1)))
                    }
                    None if !complete => {
                        // The chunks before the drop reach the client first.
                        actix_web::rt::time::sleep(interval).await;
                        Some((
                            Err(actix_web::error::ErrorInternalServerError(
                                "dropped mid-stream",
                            )),
                            (events, sent),
                        ))
                    }
                    None => None,
                }
            }
        });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .streaming(body)
}

/// The deltas a chat completion streams as: its text word by word, then
/// each tool call as a head (index, id, type, name) and its arguments in two
/// pieces.
fn deltas_of(response: &Value) -> Vec<Value> {
    let message = &response["choices"][0]["message"];
    let mut deltas: Vec<Value> = message["content"]
        .as_str()
        .unwrap_or_default()
        .split_inclusive(' ')
        .map(|word| json!({ "content": word }))
        .collect();
    for (index, call) in message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let head = json!({ "index": index, "id": call["id"], "type": "function",
            "function": { "name": call["function"]["name"], "arguments": "" } });
        deltas.push(json!({ "tool_calls": [head] }));
        let arguments = call["function"]["arguments"].as_str().unwrap_or_default();
        let mut half = arguments.len() / 2;
        while !arguments.is_char_boundary(half) {
            half += 1;
        }
        for piece in [&arguments[..half], &arguments[half..]] {
            deltas.push(json!({ "tool_calls": [
                { "index": index, "function": { "arguments": piece } }
            ] }));
        }
    }
    deltas
}

/// Anthropic's Messages API: no de-duplication, every request works.
async fn messages(
    state: web::Data<State>,
    req: HttpRequest,
    body: web::Json<Value>,
) -> HttpResponse {
    let body = body.into_inner();
    let (key, behaviour, refused, _answering) = receive(&state, &req, &body);
    if let Some(answer) = refused {
        return answer;
    }
    if let Some(problem) = invalid_messages_request(&body) {
        return HttpResponse::BadRequest()
            .json(json!({ "type": "error", "error": { "type": "invalid_request_error", "message": problem } }));
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return stream_anthropic(&state, key, &body);
    }
    let n = count_work(&state, key.as_ref());
    take_time(&state, &behaviour).await;
    let responder = state.anthropic_responder.lock().expect("lock").clone();
    let response = match responder {
        Some(f) => f(&body, n),
        None => anthropic_echo(&body, n),
    };
    if let Behaviour::LoseResponse(hold) = behaviour {
        actix_web::rt::time::sleep(hold).await;
    }
    HttpResponse::Ok().json(response)
}

/// What the real Messages API refuses, as far as onceflow's requests go:
/// no `max_tokens`, no messages, a role other than user or assistant (the
/// system prompt is a field of its own), an empty turn, a tool without an
/// object `input_schema`.
fn invalid_messages_request(body: &Value) -> Option<String> {
    if !body["max_tokens"].is_u64() {
        return Some("max_tokens: field required".into());
    }
    let Some(messages) = body["messages"].as_array().filter(|m| !m.is_empty()) else {
        return Some("messages: at least one message is required".into());
    };
    for m in messages {
        if m["role"] != "user" && m["role"] != "assistant" {
            return Some(format!(
                "messages: role must be user or assistant, not {}",
                m["role"]
            ));
        }
        let empty = match &m["content"] {
            Value::String(s) => s.is_empty(),
            Value::Array(blocks) => blocks.is_empty(),
            _ => true,
        };
        if empty {
            return Some("messages: all messages must have non-empty content".into());
        }
    }
    for t in body["tools"].as_array().into_iter().flatten() {
        if !t["input_schema"].is_object() {
            return Some("tools: input_schema must be an object".into());
        }
    }
    None
}

fn anthropic_echo(request: &Value, n: u64) -> Value {
    let last = &request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default()["content"];
    let text = match last {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| {
                b["text"]
                    .as_str()
                    .or(b["content"].as_str())
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    json!({
        "id": format!("msg_{n}"),
        "type": "message",
        "role": "assistant",
        "model": request["model"],
        "content": [{ "type": "text", "text": format!("echo: {text} (#{n})") }],
        "stop_reason": "end_turn",
        "usage": { "input_tokens": 9, "output_tokens": 4 }
    })
}

async fn chat(state: web::Data<State>, req: HttpRequest, body: web::Json<Value>) -> HttpResponse {
    let body = body.into_inner();
    let (key, behaviour, refused, _answering) = receive(&state, &req, &body);
    if let Some(answer) = refused {
        return answer;
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return stream(&state, key, &body);
    }
    // Idempotency: a finished key replays; an unfinished one waits.
    if let Some(key) = &key {
        loop {
            let existing = state.work.lock().expect("lock").get(key).cloned();
            match existing {
                Some((_, Some(response))) => return HttpResponse::Ok().json(response),
                Some((_, None)) => actix_web::rt::time::sleep(Duration::from_millis(10)).await,
                None => break,
            }
        }
    }
    let n = count_work(&state, key.as_ref());
    take_time(&state, &behaviour).await;
    let responder = state.responder.lock().expect("lock").clone();
    let response = match responder {
        Some(f) => f(&body, n),
        None => echo(&body, n),
    };
    if let Some(key) = &key {
        if let Some(entry) = state.work.lock().expect("lock").get_mut(key) {
            entry.1 = Some(response.clone());
        }
    }
    if let Behaviour::LoseResponse(hold) = behaviour {
        actix_web::rt::time::sleep(hold).await;
    }
    HttpResponse::Ok().json(response)
}
