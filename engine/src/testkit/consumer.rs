//! A fake webhook consumer that treats a repeated `webhook-id` as a no-op, as
//! the README asks real consumers to: it records every request and marks the
//! repeats.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::Value;

use super::server::{self, Behaviour, Script};

/// One webhook request received.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The `Idempotency-Key` header, if sent.
    pub idempotency_key: Option<String>,
    /// The `webhook-id` header, if sent.
    pub webhook_id: Option<String>,
    /// The `webhook-timestamp` header, if sent.
    pub timestamp: Option<String>,
    /// The `webhook-signature` header, if sent.
    pub signature: Option<String>,
    /// The `traceparent` header, if sent.
    pub traceparent: Option<String>,
    /// The body, parsed as JSON.
    pub body: Value,
    /// The body as received (what the signature covers).
    pub raw: Vec<u8>,
    /// The consumer had already processed this `webhook-id`.
    pub duplicate: bool,
    /// What the consumer answered (or would have, for a lost response).
    pub status: u16,
    /// When the request arrived.
    pub received_at: std::time::Instant,
    /// Its sequence number at this consumer (0-based).
    pub received: usize,
}

#[derive(Default)]
struct State {
    deliveries: Mutex<Vec<Delivery>>,
    processed: Mutex<HashSet<String>>,
    script: Script,
    /// Scripts for the requests whose body names a job id.
    per_job: Mutex<std::collections::HashMap<String, std::collections::VecDeque<Behaviour>>>,
}

/// The fake consumer. Cheap to clone.
#[derive(Clone)]
pub struct FakeConsumer {
    addr: SocketAddr,
    state: Arc<State>,
}

impl std::fmt::Debug for FakeConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FakeConsumer({})", self.addr)
    }
}

impl FakeConsumer {
    /// Starts the consumer on a loopback port, in a thread of its own.
    pub fn start() -> Self {
        let state = Arc::new(State::default());
        let data = web::Data::from(state.clone());
        let addr = server::spawn("fake-consumer", move |cfg| {
            cfg.app_data(data.clone())
                .default_service(web::post().to(receive));
        });
        FakeConsumer { addr, state }
    }

    /// A webhook URL on this consumer.
    pub fn url(&self) -> String {
        format!("http://{}/hooks/completed", self.addr)
    }

    /// Scripts the next request.
    pub fn push(&self, b: Behaviour) {
        self.state.script.push(b);
    }

    /// Scripts the next request whose body names `job_id` (before the shared script).
    pub fn push_for(&self, job_id: &str, b: Behaviour) {
        self.state
            .per_job
            .lock()
            .expect("lock")
            .entry(job_id.to_owned())
            .or_default()
            .push_back(b);
    }

    /// How many requests arrived (without copying them).
    pub fn delivery_count(&self) -> usize {
        self.state.deliveries.lock().expect("lock").len()
    }

    /// Every request received, in order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state.deliveries.lock().expect("lock").clone()
    }

    /// Requests whose body names `job_id` (see [`job_of`]).
    pub fn deliveries_for(&self, job_id: &str) -> Vec<Delivery> {
        self.deliveries()
            .into_iter()
            .filter(|d| job_of(&d.body) == Some(job_id))
            .collect()
    }

    /// Events processed (first sight of a `webhook-id` answered 2xx) for `job_id`.
    pub fn processed_for(&self, job_id: &str) -> usize {
        self.deliveries_for(job_id)
            .iter()
            .filter(|d| !d.duplicate && (200..300).contains(&d.status))
            .count()
    }

    /// Requests carrying `Idempotency-Key: key`.
    pub fn requests_with_key(&self, key: &str) -> usize {
        self.deliveries()
            .iter()
            .filter(|d| d.idempotency_key.as_deref() == Some(key))
            .count()
    }

    /// Times the side effect under `Idempotency-Key: key` was processed
    /// (first sight answered 2xx); repeats are not counted.
    pub fn processed_with_key(&self, key: &str) -> usize {
        self.deliveries()
            .iter()
            .filter(|d| {
                d.idempotency_key.as_deref() == Some(key)
                    && !d.duplicate
                    && (200..300).contains(&d.status)
            })
            .count()
    }

    /// Distinct `webhook-id`s seen.
    pub fn distinct_keys(&self) -> usize {
        self.deliveries()
            .iter()
            .filter_map(|d| d.webhook_id.clone())
            .collect::<HashSet<_>>()
            .len()
    }
}

fn header(req: &HttpRequest, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The job a request's body names: an onceflow event's `data.job_id`
/// (the Standard Webhooks envelope), or the top-level `job_id` a
/// workflow's own side effect may send.
pub(crate) fn job_of(body: &Value) -> Option<&str> {
    body["data"]["job_id"]
        .as_str()
        .or_else(|| body["job_id"].as_str())
}

async fn receive(state: web::Data<State>, req: HttpRequest, raw: web::Bytes) -> HttpResponse {
    let received_at = std::time::Instant::now();
    let body: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    let for_job = job_of(&body).and_then(|id| {
        state
            .per_job
            .lock()
            .expect("lock")
            .get_mut(id)
            .and_then(|q| q.pop_front())
    });
    let behaviour = for_job.unwrap_or_else(|| state.script.next());
    let webhook_id = header(&req, "webhook-id");
    let status = match behaviour {
        Behaviour::Status(code, _) => code,
        Behaviour::Ok | Behaviour::Slow(_) | Behaviour::LoseResponse(_) => 200,
    };
    if let Behaviour::Slow(d) = behaviour {
        actix_web::rt::time::sleep(d).await;
    }
    // Processing happens on a 2xx only; a repeat of a processed id is a no-op.
    // Webhooks carry `webhook-id`; tool and step requests `Idempotency-Key`.
    let dedupe_key = webhook_id
        .clone()
        .or_else(|| header(&req, "idempotency-key"));
    let duplicate = match (&dedupe_key, (200..300).contains(&status)) {
        (Some(id), true) => !state.processed.lock().expect("lock").insert(id.clone()),
        (Some(id), false) => state.processed.lock().expect("lock").contains(id),
        (None, _) => false,
    };
    let received = state.deliveries.lock().expect("lock").len();
    state.deliveries.lock().expect("lock").push(Delivery {
        idempotency_key: header(&req, "idempotency-key"),
        webhook_id,
        timestamp: header(&req, "webhook-timestamp"),
        signature: header(&req, "webhook-signature"),
        traceparent: header(&req, "traceparent"),
        body,
        raw: raw.to_vec(),
        duplicate,
        status,
        received_at,
        received,
    });
    if let Behaviour::LoseResponse(hold) = behaviour {
        actix_web::rt::time::sleep(hold).await;
    }
    let mut response =
        HttpResponse::build(actix_web::http::StatusCode::from_u16(status).expect("status"));
    if let Behaviour::Status(_, Some(secs)) = behaviour {
        response.insert_header(("retry-after", secs.to_string()));
    }
    response.finish()
}
