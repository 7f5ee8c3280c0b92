//! OpenTelemetry: spans and metrics exported over OTLP/HTTP to a real
//! receiver (decoding the protobuf), counted against what the fake provider
//! and consumer recorded; `/metrics` as Prometheus text; nothing sent when no
//! endpoint is set; a flush on SIGTERM.

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use onceflow_engine::api::{ApiState, DEFAULT_BODY_LIMIT};
use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::rules::traceparent::TraceParent;
use onceflow_engine::testkit::{
    database, wait_until, Behaviour, FakeConsumer, FakeProvider, TestEnv,
};
use onceflow_engine::JobState;
use onceflow_observability::names::*;
use onceflow_observability::{Telemetry, TelemetryConfig};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue as ProtoKv;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Number;
use prost::Message;
use serde_json::{json, Value};

use crate::support::{client, serve_api_state, ServeProcess};

const WAIT: Duration = Duration::from_secs(30);

// ---- a real OTLP/HTTP receiver ---------------------------------------------

#[derive(Default)]
struct Received {
    traces: Vec<ExportTraceServiceRequest>,
    metrics: Vec<ExportMetricsServiceRequest>,
    /// Every request, whatever its path.
    requests: usize,
}

/// An OTLP/HTTP receiver on its own thread and actix System.
#[derive(Clone)]
struct Receiver {
    addr: std::net::SocketAddr,
    received: Arc<Mutex<Received>>,
}

impl Receiver {
    fn start() -> Receiver {
        Self::on(TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn on(listener: TcpListener) -> Receiver {
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Received::default()));
        let data = web::Data::from(received.clone());
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                HttpServer::new(move || {
                    App::new()
                        .app_data(data.clone())
                        .app_data(web::PayloadConfig::new(64 << 20))
                        .default_service(web::to(receive))
                })
                .workers(1)
                .disable_signals()
                .listen(listener)
                .unwrap()
                .run()
                .await
                .unwrap()
            })
        });
        Receiver { addr, received }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> usize {
        self.received.lock().unwrap().requests
    }

    fn spans(&self) -> Vec<Span> {
        let r = self.received.lock().unwrap();
        r.traces
            .iter()
            .flat_map(|t| &t.resource_spans)
            .flat_map(|rs| {
                let service = rs
                    .resource
                    .as_ref()
                    .map(|r| attrs(&r.attributes))
                    .and_then(|a| a.get("service.name").cloned())
                    .unwrap_or_default();
                rs.scope_spans
                    .iter()
                    .flat_map(|ss| &ss.spans)
                    .map(move |s| Span {
                        name: s.name.clone(),
                        trace_id: hex::encode(&s.trace_id),
                        span_id: hex::encode(&s.span_id),
                        parent: hex::encode(&s.parent_span_id),
                        attrs: attrs(&s.attributes),
                        service: service.clone(),
                    })
            })
            .collect()
    }

    /// The last exported value of each counter data point, keyed by metric
    /// name and sorted attributes (cumulative temporality).
    fn counters(&self) -> HashMap<(String, String), i64> {
        let r = self.received.lock().unwrap();
        let mut out = HashMap::new();
        for m in r
            .metrics
            .iter()
            .flat_map(|m| &m.resource_metrics)
            .flat_map(|rm| &rm.scope_metrics)
            .flat_map(|sm| &sm.metrics)
        {
            let Some(Data::Sum(sum)) = &m.data else {
                continue;
            };
            for p in &sum.data_points {
                let value = match p.value {
                    Some(Number::AsInt(v)) => v,
                    Some(Number::AsDouble(v)) => v as i64,
                    None => continue,
                };
                out.insert((m.name.clone(), label(&attrs(&p.attributes))), value);
            }
        }
        out
    }
}

async fn receive(
    req: actix_web::HttpRequest,
    body: web::Bytes,
    received: web::Data<Mutex<Received>>,
) -> HttpResponse {
    let mut r = received.lock().unwrap();
    r.requests += 1;
    match req.path() {
        "/v1/traces" => r
            .traces
            .push(ExportTraceServiceRequest::decode(body).expect("OTLP trace protobuf")),
        "/v1/metrics" => r
            .metrics
            .push(ExportMetricsServiceRequest::decode(body).expect("OTLP metrics protobuf")),
        other => panic!("unexpected OTLP path {other}"),
    }
    HttpResponse::Ok()
        .content_type("application/x-protobuf")
        .body(Vec::new())
}

#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    attrs: BTreeMap<String, String>,
    service: String,
}

impl Span {
    fn attr(&self, k: &str) -> &str {
        self.attrs.get(k).map(String::as_str).unwrap_or("")
    }
}

fn attrs(kvs: &[ProtoKv]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(AnyValue::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// `k="v",…` in key order, as both OTLP and Prometheus label sets are compared.
fn label(attrs: &BTreeMap<String, String>) -> String {
    attrs
        .iter()
        .map(|(k, v)| format!("{}=\"{v}\"", k.replace('.', "_")))
        .collect::<Vec<_>>()
        .join(",")
}

fn key(name: &str, attrs: &[(&str, &str)]) -> (String, String) {
    let map: BTreeMap<String, String> = attrs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (name.to_owned(), label(&map))
}

/// Parses Prometheus text: every sample line must be `name[{labels}] number`.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            assert!(
                rest.starts_with("HELP ") || rest.starts_with("TYPE "),
                "bad comment line {line:?}"
            );
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample has a value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unclosed labels in {line:?}");
        }
        out.insert(series.to_owned(), value);
    }
    out
}

fn completion(id: &str, hook: &str) -> Value {
    json!({
        "id": id, "workflow": "completion", "webhook_url": hook,
        "input": { "model": "m", "messages": [{ "role": "user", "content": format!("hi {id}") }] },
    })
}

/// Telemetry of service `onceflow-it` exporting to `receiver` over OTLP.
fn exporting_to(receiver: &Receiver) -> Arc<Telemetry> {
    let endpoint = receiver.endpoint();
    let config = TelemetryConfig::from_lookup(|k| match k {
        "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(endpoint.clone()),
        "OTEL_SERVICE_NAME" => Some("onceflow-it".to_owned()),
        _ => None,
    })
    .unwrap();
    Arc::new(Telemetry::new(config).unwrap())
}

/// A metric name and its attributes.
type Series<'a> = (&'a str, Vec<(&'a str, &'a str)>);

// ---- the tests --------------------------------------------------------------

#[actix_rt::test]
async fn spans_and_metrics_arrive_over_otlp_and_match_what_the_fakes_recorded() {
    let env = TestEnv::new().await;
    let receiver = Receiver::start();
    let telemetry = exporting_to(&receiver);
    let registry = onceflow_workflows::registry();
    let base = serve_api_state(ApiState {
        store: env.store.clone(),
        registry: registry.clone(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: telemetry.clone(),
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        hosts: onceflow_engine::api::Hosts::Any,
        auth: onceflow_engine::api::Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
    });
    // clean: nothing goes wrong. faulty: the provider's answer is lost after
    // it did the work, then the consumer fails once. ackfail: the commit of
    // the delivery and the ack fails after the consumer answered, so the
    // rerun sends again under the same key and the consumer drops the repeat.
    env.faults
        .arm_once("otel-faulty", FailPoint::ModelAfterSend, Action::Fail);
    env.consumer
        .push_for("otel-faulty", Behaviour::Status(503, None));
    env.faults.arm_once(
        "otel-ackfail",
        FailPoint::BeforeCommit("acked"),
        Action::Fail,
    );
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    let engine = env.start(registry, config);

    let ids = ["otel-clean", "otel-faulty", "otel-ackfail"];
    for id in ids {
        let r = client()
            .post(format!("{base}/v1/jobs"))
            .json(&completion(id, &env.consumer.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
    let mut attempts = HashMap::new();
    let mut traces = HashMap::new();
    for id in ids {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        attempts.insert(id, job.attempts as usize);
        traces.insert(id, job.trace_id.clone().expect("a trace id"));
    }
    assert_eq!(attempts["otel-clean"], 1);
    assert_eq!(attempts["otel-faulty"], 3);
    assert_eq!(attempts["otel-ackfail"], 2);

    // `/metrics` before the pipeline shuts down.
    let text = crate::support::get_text(&format!("{base}/metrics")).await;
    engine.shutdown();
    let tel = telemetry.clone();
    tokio::task::spawn_blocking(move || tel.shutdown())
        .await
        .unwrap()
        .expect("telemetry flushes");

    // ---- spans
    let spans = receiver.spans();
    assert!(spans.iter().all(|s| s.service == "onceflow-it"));
    for id in ids {
        let trace = &traces[id];
        let jobs: Vec<&Span> = spans
            .iter()
            .filter(|s| s.name == SPAN_JOB && s.attr(JOB_ID) == id)
            .collect();
        assert_eq!(jobs.len(), attempts[id], "one job span per attempt of {id}");
        let mut numbers: Vec<&str> = jobs.iter().map(|s| s.attr(JOB_ATTEMPT)).collect();
        numbers.sort();
        let expected: Vec<String> = (1..=attempts[id]).map(|n| n.to_string()).collect();
        assert_eq!(
            numbers,
            expected.iter().map(String::as_str).collect::<Vec<_>>()
        );
        for s in &jobs {
            assert_eq!(&s.trace_id, trace, "every attempt of {id} is in its trace");
            assert_eq!(s.attr(WORKFLOW_NAME), "completion");
            assert!(s.attr(LEASE_EPOCH).parse::<i64>().unwrap() >= 1);
        }
        // The intake span is the attempts' parent.
        let submit = spans
            .iter()
            .find(|s| s.name == SPAN_SUBMIT && s.attr(JOB_ID) == id)
            .expect("a submit span");
        assert_eq!(&submit.trace_id, trace);
        assert!(jobs.iter().all(|j| j.parent == submit.span_id));
        // Every step span is a child of one of this job's attempts.
        let job_span_ids: Vec<&str> = jobs.iter().map(|s| s.span_id.as_str()).collect();
        let steps: Vec<&Span> = spans
            .iter()
            .filter(|s| job_span_ids.contains(&s.parent.as_str()))
            .collect();
        assert!(steps.iter().all(|s| &s.trace_id == trace));
        // The traceparent the provider and the consumer saw is a step span
        // of this trace: generate for the model, deliver for the webhook.
        let model_key = format!("job:{id}:generate");
        let sent: Vec<(String, &str)> = env
            .provider
            .requests()
            .into_iter()
            .filter(|r| r.idempotency_key.as_deref() == Some(model_key.as_str()))
            .map(|r| (r.traceparent.expect("traceparent"), SPAN_GENERATE))
            .chain(
                env.consumer
                    .deliveries_for(id)
                    .into_iter()
                    .map(|d| (d.traceparent.expect("traceparent"), SPAN_DELIVER)),
            )
            .collect();
        assert!(!sent.is_empty());
        for (tp, name) in sent {
            let tp = TraceParent::parse(&tp).unwrap();
            assert_eq!(&tp.trace_id_hex(), trace);
            let span = hex::encode(tp.span_id);
            assert!(
                steps.iter().any(|s| s.span_id == span && s.name == name),
                "{name} request of {id} carries span {span}, not one of its {name} spans"
            );
        }
    }
    let steps_of = |id: &str, name: &str| -> Vec<Span> {
        let jobs: Vec<String> = spans
            .iter()
            .filter(|s| s.name == SPAN_JOB && s.attr(JOB_ID) == id)
            .map(|s| s.span_id.clone())
            .collect();
        spans
            .iter()
            .filter(|s| s.name == name && jobs.contains(&s.parent))
            .cloned()
            .collect()
    };
    // The clean job: one span per step, each performed.
    for name in [
        SPAN_GENERATE,
        SPAN_PERSIST,
        SPAN_CLAIM,
        SPAN_DELIVER,
        SPAN_ACK,
    ] {
        let found = steps_of("otel-clean", name);
        assert_eq!(found.len(), 1, "one {name} span: {found:?}");
        assert_eq!(found[0].attr(OUTCOME), OUTCOME_PERFORMED, "{name}");
    }
    let generate = &steps_of("otel-clean", SPAN_GENERATE)[0];
    assert_eq!(generate.attr(IDEMPOTENCY_KEY), "job:otel-clean:generate");
    assert_eq!(generate.attr(GEN_AI_REQUEST_MODEL), "m");
    assert_eq!(generate.attr(GEN_AI_INPUT_TOKENS), "7");
    assert_eq!(generate.attr(GEN_AI_OUTPUT_TOKENS), "3");
    assert_eq!(generate.attr(HTTP_STATUS), "200");
    let deliver = &steps_of("otel-clean", SPAN_DELIVER)[0];
    assert_eq!(deliver.attr(IDEMPOTENCY_KEY), "job:otel-clean:completed");
    assert_eq!(deliver.attr(HTTP_STATUS), "200");
    assert_eq!(
        steps_of("otel-clean", SPAN_PERSIST)[0].attr(TRANSITION),
        "received->persisted"
    );
    // The faulty job: the lost answer and the 503 are retried with the same key.
    let outcomes = |id: &str, name: &str| {
        let mut o: Vec<String> = steps_of(id, name)
            .iter()
            .map(|s| s.attr(OUTCOME).to_owned())
            .collect();
        o.sort();
        o
    };
    assert_eq!(
        outcomes("otel-faulty", SPAN_GENERATE),
        ["performed", "retried"]
    );
    assert_eq!(
        outcomes("otel-faulty", SPAN_DELIVER),
        ["performed", "retried"]
    );
    assert!(steps_of("otel-faulty", SPAN_DELIVER)
        .iter()
        .any(|s| s.attr(HTTP_STATUS) == "503" && s.attr(OUTCOME) == OUTCOME_RETRIED));
    // ackfail: the failed commit fails both spans; the rerun sends again.
    assert_eq!(
        outcomes("otel-ackfail", SPAN_DELIVER),
        ["failed", "performed"]
    );
    assert_eq!(outcomes("otel-ackfail", SPAN_ACK), ["failed", "performed"]);

    // ---- metrics: OTLP counters against the fakes' own records
    let counters = receiver.counters();
    let counter = |name: &str, attrs: &[(&str, &str)]| -> i64 {
        counters.get(&key(name, attrs)).copied().unwrap_or(0)
    };
    let provider_requests = env.provider.requests().len() as i64;
    let provider_work = env.provider.total_work() as i64;
    let deliveries = env.consumer.deliveries();
    let consumer_ok = deliveries
        .iter()
        .filter(|d| (200..300).contains(&d.status) && !d.duplicate)
        .count() as i64;
    let consumer_failed = deliveries.iter().filter(|d| d.status >= 300).count() as i64;
    let consumer_dupes = deliveries.iter().filter(|d| d.duplicate).count() as i64;
    assert_eq!((provider_work, provider_requests), (3, 4));
    assert_eq!((consumer_ok, consumer_failed, consumer_dupes), (3, 1, 1));

    let expect: Vec<(Series, i64)> = vec![
        (
            (METRIC_MODEL_CALLS, vec![(OUTCOME, OUTCOME_PERFORMED)]),
            provider_work,
        ),
        // The provider dropped the repeat of the lost answer's key.
        (
            (METRIC_MODEL_CALLS, vec![(OUTCOME, OUTCOME_RETRIED)]),
            provider_requests - provider_work,
        ),
        (
            (METRIC_DELIVERIES, vec![(OUTCOME, OUTCOME_DELIVERED)]),
            consumer_ok,
        ),
        (
            (METRIC_DELIVERIES, vec![(OUTCOME, OUTCOME_RETRIED)]),
            consumer_failed,
        ),
        ((METRIC_TRANSITIONS, vec![(STATE, "acked")]), 3),
        (
            (
                METRIC_JOBS_SUBMITTED,
                vec![(SUBMIT_OUTCOME, "created"), (WORKFLOW_NAME, "completion")],
            ),
            3,
        ),
        // 7 prompt tokens per answered request, one answered request per job.
        (
            (
                METRIC_MODEL_TOKENS,
                vec![(GEN_AI_TOKEN_TYPE, "input"), (RETRY, "false")],
            ),
            14,
        ),
        (
            (
                METRIC_MODEL_TOKENS,
                vec![(GEN_AI_TOKEN_TYPE, "input"), (RETRY, "true")],
            ),
            7,
        ),
    ];
    let prom = parse_prometheus(&text);
    for ((name, attrs), want) in &expect {
        assert_eq!(
            counter(name, attrs),
            *want,
            "OTLP {name} {attrs:?}: {counters:?}"
        );
        let series = format!(
            "{}{{{}}}",
            onceflow_observability::prometheus::metric_name(name, "", true),
            key(name, attrs).1
        );
        assert_eq!(
            prom.get(&series).copied(),
            Some(*want as f64),
            "/metrics {series}:\n{text}"
        );
    }
    assert!(
        text.contains("# TYPE onceflow_step_duration_seconds histogram"),
        "{text}"
    );
    assert!(prom
        .keys()
        .any(|k| k.starts_with("onceflow_step_duration_seconds_bucket{")));
}

/// Prometheus series value from a scrape of `telemetry`.
fn scraped(telemetry: &Telemetry, name: &str, attrs: &[(&str, &str)]) -> Option<f64> {
    let series = format!(
        "{}{{{}}}",
        onceflow_observability::prometheus::metric_name(name, "", true),
        key(name, attrs).1
    );
    parse_prometheus(&telemetry.prometheus())
        .get(&series)
        .copied()
}

#[actix_rt::test]
async fn a_race_of_two_attempts_counts_the_suppressed_duplicates() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    let telemetry = Arc::new(Telemetry::disabled());
    let reg = onceflow_workflows::registry();
    env.submit("otel-race", "hi").await;
    // A slow consumer: the other attempt reaches delivery while the send is
    // in flight, and must wait for it rather than send again.
    env.consumer
        .push_for("otel-race", Behaviour::Slow(Duration::from_millis(1000)));
    // Two attempts that both believe they hold the lease: only the journal
    // and the constraints stand between them.
    let leased = env.lease("node-a", Duration::from_secs(60)).await;
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    tokio::join!(
        env.run_attempt(&reg, leased.clone(), config.clone()),
        env.run_attempt(&reg, leased, config),
    );
    let deliveries = env.consumer.deliveries_for("otel-race");
    assert_eq!(deliveries.len(), 1, "the consumer got one request");
    assert_eq!(env.provider.total_work(), 1);
    assert_eq!(env.provider.requests().len(), 1);
    let m = |name: &str, outcome: &str| scraped(&telemetry, name, &[(OUTCOME, outcome)]);
    assert_eq!(m(METRIC_MODEL_CALLS, OUTCOME_PERFORMED), Some(1.0));
    // The second attempt waited for the first one's answer in the journal.
    assert_eq!(m(METRIC_MODEL_CALLS, OUTCOME_REPLAYED), Some(1.0));
    assert_eq!(m(METRIC_DELIVERIES, OUTCOME_DELIVERED), Some(1.0));
    // … and found the delivery journaled instead of sending it again.
    assert_eq!(
        m(METRIC_DELIVERIES, OUTCOME_DUPLICATE_SUPPRESSED),
        Some(1.0)
    );
    assert_eq!(
        scraped(&telemetry, METRIC_TRANSITIONS, &[(STATE, "claimed")]),
        Some(1.0),
        "one attempt's claim committed, the other's was suppressed"
    );
}

/// The standard OTLP/HTTP port: where an SDK that exported by default would send.
const OTLP_DEFAULT_PORT: u16 = 4318;

async fn one_job_through_serve(env: &[(&str, String)], log: &std::path::Path) {
    let mut serve = ServeProcess::start(env, log).await;
    let consumer = FakeConsumer::start();
    let r = client()
        .post(format!("{}/v1/jobs", serve.base))
        .json(&completion("otel-serve", &consumer.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert!(
        wait_until(WAIT, || async { !consumer.deliveries().is_empty() }).await,
        "the job was not delivered; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let status = serve.sigterm();
    assert!(status.success(), "serve exited with {status}");
}

#[actix_rt::test]
async fn serve_sends_nothing_without_an_endpoint() {
    let listener = TcpListener::bind(("127.0.0.1", OTLP_DEFAULT_PORT)).unwrap_or_else(|e| {
        panic!("this test listens on the default OTLP port {OTLP_DEFAULT_PORT}: {e}")
    });
    let receiver = Receiver::on(listener);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let provider = FakeProvider::start();
    let env = [
        ("DATABASE_URL", database::fresh().await),
        ("OPENAI_BASE_URL", provider.base_url()),
        // Everything but an endpoint.
        ("OTEL_SERVICE_NAME", "onceflow-quiet".to_owned()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "100".to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
    ];
    one_job_through_serve(&env, &log).await;
    assert_eq!(provider.total_work(), 1);
    assert_eq!(
        receiver.requests(),
        0,
        "nothing is sent without an endpoint"
    );
}

#[actix_rt::test]
async fn serve_flushes_spans_and_metrics_on_sigterm() {
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let provider = FakeProvider::start();
    let env = [
        ("DATABASE_URL", database::fresh().await),
        ("OPENAI_BASE_URL", provider.base_url()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        // Nothing would be exported on its own within the test.
        ("OTEL_METRIC_EXPORT_INTERVAL", "600000".to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "600000".to_owned()),
    ];
    one_job_through_serve(&env, &log).await;
    let spans = receiver.spans();
    let job: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == SPAN_JOB && s.attr(JOB_ID) == "otel-serve")
        .collect();
    assert_eq!(job.len(), 1, "the attempt's span was flushed: {spans:?}");
    assert_eq!(job[0].service, "onceflow");
    let counters = receiver.counters();
    assert_eq!(
        counters.get(&key(METRIC_MODEL_CALLS, &[(OUTCOME, OUTCOME_PERFORMED)])),
        Some(&1),
        "{counters:?}"
    );
}

/// A streamed answer shows on telemetry: its `generate` span counts the
/// chunks it journaled (8, as the fake streamed), and time to first token
/// and tokens per second are recorded once. The model label comes from a
/// bounded set: a model `ONCEFLOW_LIMITS` names is its own label, any
/// other (a caller's 300-byte name) is `other`, and never appears.
#[actix_rt::test]
async fn a_streamed_answer_counts_its_chunks_and_its_pace() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(8, Duration::from_millis(10));
    let receiver = Receiver::start();
    let telemetry = exporting_to(&receiver);
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: "otel-stream".into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({
            "model": "test-model",
            "stream": true,
            "messages": [{ "role": "user", "content": "hi" }]
        }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let odd_model = format!("odd-{}", "x".repeat(300));
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: "otel-stream-odd".into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({
            "model": odd_model,
            "stream": true,
            "messages": [{ "role": "user", "content": "hi" }]
        }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    config.limits =
        onceflow_engine::rules::quota::Limits::parse(r#"{"test-model": {"concurrency": 100}}"#)
            .unwrap();
    let engine = env.start(onceflow_workflows::registry(), config);
    assert!(
        wait_until(Duration::from_secs(30), || async {
            env.job("otel-stream").await.state == JobState::Acked
                && env.job("otel-stream-odd").await.state == JobState::Acked
        })
        .await
    );
    let count = |name: &str, unit: &str, model: &str| {
        let series = format!(
            "{}_count{{{}}}",
            onceflow_observability::prometheus::metric_name(name, unit, false),
            key(name, &[(GEN_AI_REQUEST_MODEL, model)]).1
        );
        parse_prometheus(&telemetry.prometheus())
            .get(&series)
            .copied()
    };
    assert_eq!(
        count(METRIC_STREAM_TTFT, "s", "test-model"),
        Some(1.0),
        "{}",
        telemetry.prometheus()
    );
    assert_eq!(
        count(METRIC_STREAM_TOKENS_PER_SECOND, "", "test-model"),
        Some(1.0)
    );
    assert_eq!(count(METRIC_STREAM_TTFT, "s", "other"), Some(1.0));
    assert!(
        !telemetry.prometheus().contains("xxxxxxxxxx"),
        "a caller's model name became a label"
    );
    engine.shutdown();
    let tel = telemetry.clone();
    tokio::task::spawn_blocking(move || tel.shutdown())
        .await
        .unwrap()
        .expect("telemetry flushes");
    let generate: Vec<Span> = receiver
        .spans()
        .into_iter()
        .filter(|s| s.name == SPAN_GENERATE)
        .collect();
    assert_eq!(generate.len(), 2);
    assert!(generate.iter().all(|g| g.attr(STREAM_CHUNKS) == "8"));
    assert_eq!(env.provider.chunks_streamed(), 16);
}

/// A direct scrape of a fresh node says which node answered (`target_info`
/// with its `service_instance_id`) and shows its series at zero before any
/// job, so panels read 0 rather than "No data".
#[actix_rt::test]
async fn a_fresh_nodes_scrape_names_the_node_and_starts_its_series_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", database::fresh().await),
            ("ONCEFLOW_NODE_ID", "node-scraped".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let text = crate::support::get_text(&format!("{}/metrics", serve.base)).await;
    let target = text
        .lines()
        .find(|l| l.starts_with("target_info{"))
        .unwrap_or_else(|| panic!("no target_info:\n{text}"));
    assert!(
        target.contains("service_instance_id=\"node-scraped\""),
        "{target}"
    );
    assert!(target.ends_with(" 1"), "{target}");
    let scraped = parse_prometheus(&text);
    for series in [
        "onceflow_deliveries_total{onceflow_outcome=\"delivered\"}",
        "onceflow_deliveries_total{onceflow_outcome=\"dead\"}",
        "onceflow_model_calls_total{onceflow_outcome=\"performed\"}",
        "onceflow_lease_takeovers_total",
        "onceflow_actors_in_flight",
    ] {
        assert_eq!(scraped.get(series), Some(&0.0), "{series} at zero:\n{text}");
    }
}

/// A tool call's span follows the GenAI conventions for a tool's
/// execution (`gen_ai.operation.name` = `execute_tool`, the tool's name and
/// call id) and carries the call's idempotency key; the `traceparent` the
/// tool's endpoint received is that span's, in the job's trace.
#[actix_rt::test]
async fn a_tool_call_is_an_execute_tool_span_the_tool_saw() {
    let env = TestEnv::new().await;
    let receiver = Receiver::start();
    let endpoint = receiver.endpoint();
    let config = TelemetryConfig::from_lookup(|k| match k {
        "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(endpoint.clone()),
        _ => None,
    })
    .unwrap();
    let telemetry = Arc::new(Telemetry::new(config).unwrap());
    let tools = FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_7", json!({ "ticket": 7 }))]);
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    let engine = env.start(
        onceflow_workflows::registry_with(Some(&tools.url())),
        config,
    );
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: "otel-tool".into(),
        workflow: "agent".into(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "file it" }] }),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("otel-tool", JobState::Acked, WAIT).await;
    engine.shutdown();
    let tel = telemetry.clone();
    tokio::task::spawn_blocking(move || tel.shutdown())
        .await
        .unwrap()
        .expect("telemetry flushes");
    let spans = receiver.spans();
    let tool_spans: Vec<&Span> = spans.iter().filter(|s| s.name == SPAN_TOOL).collect();
    assert_eq!(tool_spans.len(), 1, "one tool span: {tool_spans:?}");
    let span = tool_spans[0];
    assert_eq!(span.attr(GEN_AI_OPERATION), "execute_tool");
    assert_eq!(span.attr(GEN_AI_TOOL_NAME), "http_post");
    assert_eq!(span.attr(GEN_AI_TOOL_CALL_ID), "call_7");
    assert_eq!(span.attr(IDEMPOTENCY_KEY), "job:otel-tool:tool:0:0");
    assert_eq!(span.attr(OUTCOME), OUTCOME_PERFORMED);
    assert_eq!(Some(&span.trace_id), job.trace_id.as_ref());
    let seen = tools.deliveries();
    assert_eq!(seen.len(), 1, "the tool ran once");
    let tp = TraceParent::parse(seen[0].traceparent.as_deref().expect("a traceparent")).unwrap();
    assert_eq!(
        hex::encode(tp.span_id),
        span.span_id,
        "the tool saw its span"
    );
}

/// A spawn continues the parent's trace: each child has a `spawn` span
/// (naming it) under one of its parent's `job` spans, and the child's own
/// `job` span is a child of that `spawn` span.
#[actix_rt::test]
async fn a_spawn_has_its_span_and_the_childs_attempt_continues_it() {
    let env = TestEnv::new().await;
    let receiver = Receiver::start();
    let telemetry = exporting_to(&receiver);
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    let engine = env.start(crate::children::registry(), config);
    env.submit_job(crate::children::parent(
        &env,
        "traced-parent",
        &["a", "b"],
        None,
    ))
    .await;
    env.wait_for("traced-parent", JobState::Acked, WAIT).await;
    engine.shutdown();
    let tel = telemetry.clone();
    tokio::task::spawn_blocking(move || tel.shutdown())
        .await
        .unwrap()
        .expect("telemetry flushes");
    let spans = receiver.spans();
    let parent_jobs: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == SPAN_JOB && s.attr(JOB_ID) == "traced-parent")
        .collect();
    assert!(!parent_jobs.is_empty(), "the parent's attempts have spans");
    for i in 0..2 {
        let child = format!("traced-parent:child:c{i}");
        let spawns: Vec<&Span> = spans
            .iter()
            .filter(|s| s.name == SPAN_SPAWN && s.attr("onceflow.child.id") == child)
            .collect();
        assert!(!spawns.is_empty(), "{child} has a spawn span: {spans:?}");
        for spawn in &spawns {
            assert!(
                parent_jobs.iter().any(|j| j.span_id == spawn.parent),
                "{child}'s spawn span is under a job span of its parent"
            );
        }
        let child_jobs: Vec<&Span> = spans
            .iter()
            .filter(|s| s.name == SPAN_JOB && s.attr(JOB_ID) == child)
            .collect();
        assert!(!child_jobs.is_empty(), "{child} has its job span");
        for j in &child_jobs {
            assert!(
                spawns.iter().any(|s| s.span_id == j.parent),
                "{child}'s attempt continues its spawn span"
            );
        }
    }
}

/// Every way a job comes in through the API is counted by the intake
/// metric: a submit, each created item of a batch, a re-run (the batch and
/// the re-run were not counted before they took the submit's path).
#[actix_rt::test]
async fn a_submit_a_batch_and_a_rerun_are_each_counted_at_intake() {
    let env = TestEnv::new().await;
    let receiver = Receiver::start();
    let telemetry = exporting_to(&receiver);
    let base = serve_api_state(ApiState {
        store: env.store.clone(),
        registry: onceflow_workflows::registry(),
        body_limit: DEFAULT_BODY_LIMIT,
        telemetry: telemetry.clone(),
        url_guard: onceflow_engine::UrlGuard::allow_private(),
        hosts: onceflow_engine::api::Hosts::Any,
        auth: onceflow_engine::api::Auth::Off,
        limits: Default::default(),
        draining: Default::default(),
        trace_url: None,
        handoff: None,
        hub: env.hub.clone(),
    });
    let hook = env.consumer.url();
    let post = |path: &str, body: Value| client().post(format!("{base}{path}")).json(&body).send();
    assert_eq!(
        post("/v1/jobs", completion("one", &hook))
            .await
            .unwrap()
            .status(),
        201
    );
    let batch = json!({ "jobs": [completion("two", &hook), completion("three", &hook)] });
    assert_eq!(post("/v1/jobs/batch", batch).await.unwrap().status(), 200);
    assert_eq!(
        post("/v1/jobs/one/rerun", json!({ "id": "four" }))
            .await
            .unwrap()
            .status(),
        201
    );
    let text = crate::support::get_text(&format!("{base}/metrics")).await;
    let created: f64 = parse_prometheus(&text)
        .iter()
        .filter(|(series, _)| {
            series.starts_with("onceflow_jobs_submitted") && series.contains("\"created\"")
        })
        .map(|(_, n)| n)
        .sum();
    assert_eq!(created, 4.0, "{text}");
}
