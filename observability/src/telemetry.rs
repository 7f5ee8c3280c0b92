//! [`Telemetry`]: the tracer and the instruments of one node, exported over
//! OTLP/HTTP when configured, and always readable as Prometheus text.

use std::sync::{Arc, Weak};
use std::time::Duration;

use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::noop::NoopTracer;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, PeriodicReader, Pipeline, SdkMeterProvider, Temporality,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

use crate::metrics::Metrics;

/// A configuration that cannot work; the message names the variable.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// An `OTEL_*` variable holds a value onceflow cannot use.
    #[error("{variable}={value:?}: {problem}")]
    Invalid {
        /// The variable's name.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        problem: String,
    },
    /// An OTLP exporter could not be built.
    #[error("building the OTLP exporter: {0}")]
    Exporter(String),
    /// Flushing spans or metrics at shutdown failed.
    #[error("flushing telemetry: {0}")]
    Flush(String),
}

/// Where OTLP goes, per signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpConfig {
    /// Full URL of the traces endpoint (`…/v1/traces`); `None` exports no spans.
    pub traces: Option<String>,
    /// Full URL of the metrics endpoint (`…/v1/metrics`); `None` exports no metrics.
    pub metrics: Option<String>,
    /// How often metrics are pushed (`OTEL_METRIC_EXPORT_INTERVAL`, ms).
    pub metric_interval: Duration,
}

/// What to export and how to name this service.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// `None`: nothing leaves the process (the default).
    pub otlp: Option<OtlpConfig>,
    /// Resource attributes, `service.name` among them.
    pub resource: Vec<KeyValue>,
}

impl TelemetryConfig {
    /// Sets `service.instance.id` to `instance` unless the resource has one.
    pub fn with_instance(mut self, instance: &str) -> Self {
        if !self
            .resource
            .iter()
            .any(|kv| kv.key.as_str() == "service.instance.id")
        {
            self.resource
                .push(KeyValue::new("service.instance.id", instance.to_owned()));
        }
        self
    }

    /// From the standard `OTEL_*` variables of the process.
    pub fn from_env() -> Result<Self, TelemetryError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// From `OTEL_*` variables looked up with `var` (tests pass their own).
    ///
    /// Honoured: `OTEL_SDK_DISABLED`, `OTEL_EXPORTER_OTLP_ENDPOINT` (with
    /// `/v1/traces` and `/v1/metrics` appended), `OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT`
    /// (used as given), `OTEL_EXPORTER_OTLP[_{TRACES,METRICS}]_PROTOCOL`
    /// (`http/protobuf` only), `OTEL_TRACES_EXPORTER`/`OTEL_METRICS_EXPORTER`
    /// (`otlp` or `none`), `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
    /// `OTEL_METRIC_EXPORT_INTERVAL`. The exporter itself reads
    /// `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_EXPORTER_OTLP_TIMEOUT`, and the
    /// batch span processor `OTEL_BSP_*`.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self, TelemetryError> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let resource = resource(&var);
        let disabled =
            var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        if disabled {
            return Ok(TelemetryConfig {
                otlp: None,
                resource,
            });
        }
        let base = var("OTEL_EXPORTER_OTLP_ENDPOINT");
        let signal = |signal: &str, path: &str| -> Result<Option<String>, TelemetryError> {
            let exporter_var = match signal {
                "TRACES" => "OTEL_TRACES_EXPORTER",
                _ => "OTEL_METRICS_EXPORTER",
            };
            match var(exporter_var).map(|v| v.trim().to_ascii_lowercase()) {
                None => {}
                Some(v) if v == "otlp" => {}
                Some(v) if v == "none" => return Ok(None),
                Some(v) => {
                    return Err(TelemetryError::Invalid {
                        variable: if signal == "TRACES" {
                            "OTEL_TRACES_EXPORTER"
                        } else {
                            "OTEL_METRICS_EXPORTER"
                        },
                        value: v,
                        problem: "onceflow exports `otlp` or `none`".into(),
                    })
                }
            }
            let own: &'static str = match signal {
                "TRACES" => "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                _ => "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            };
            let endpoint = match (var(own), &base) {
                (Some(url), _) => Some((own, url.trim().to_owned())),
                (None, Some(base)) => Some((
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    format!("{}/{path}", base.trim().trim_end_matches('/')),
                )),
                (None, None) => None,
            };
            let Some((variable, url)) = endpoint else {
                return Ok(None);
            };
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(TelemetryError::Invalid {
                    variable,
                    value: url,
                    problem: "an OTLP/HTTP endpoint must start with http:// or https://".into(),
                });
            }
            let protocol_var: &'static str = match signal {
                "TRACES" => "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                _ => "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
            };
            let protocol = var(protocol_var).map(|p| (protocol_var, p)).or_else(|| {
                var("OTEL_EXPORTER_OTLP_PROTOCOL").map(|p| ("OTEL_EXPORTER_OTLP_PROTOCOL", p))
            });
            if let Some((variable, p)) = protocol {
                if p.trim() != "http/protobuf" {
                    return Err(TelemetryError::Invalid {
                        variable,
                        value: p,
                        problem: "onceflow exports OTLP over HTTP with protobuf only; set http/protobuf and \
                                  point the endpoint at the collector's OTLP/HTTP port (4318 by default)"
                            .into(),
                    });
                }
            }
            Ok(Some(url))
        };
        let traces = signal("TRACES", "v1/traces")?;
        let metrics = signal("METRICS", "v1/metrics")?;
        let metric_interval = match var("OTEL_METRIC_EXPORT_INTERVAL") {
            None => Duration::from_secs(60),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => {
                    return Err(TelemetryError::Invalid {
                        variable: "OTEL_METRIC_EXPORT_INTERVAL",
                        value: v,
                        problem: "expected a positive number of milliseconds".into(),
                    })
                }
            },
        };
        let otlp = (traces.is_some() || metrics.is_some()).then_some(OtlpConfig {
            traces,
            metrics,
            metric_interval,
        });
        Ok(TelemetryConfig { otlp, resource })
    }
}

/// `OTEL_RESOURCE_ATTRIBUTES` (`k=v,…`, percent-encoded values) plus
/// `service.name` from `OTEL_SERVICE_NAME`, else the attributes, else `onceflow`.
fn resource(var: &impl Fn(&str) -> Option<String>) -> Vec<KeyValue> {
    let mut attrs: Vec<(String, String)> = var("OTEL_RESOURCE_ATTRIBUTES")
        .unwrap_or_default()
        .split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            let k = k.trim();
            (!k.is_empty()).then(|| (k.to_owned(), percent_decode(v.trim())))
        })
        .collect();
    if let Some(name) = var("OTEL_SERVICE_NAME") {
        attrs.retain(|(k, _)| k != "service.name");
        attrs.push(("service.name".into(), name.trim().to_owned()));
    } else if !attrs.iter().any(|(k, _)| k == "service.name") {
        attrs.push(("service.name".into(), "onceflow".into()));
    }
    attrs.push(("service.version".into(), env!("CARGO_PKG_VERSION").into()));
    attrs
        .into_iter()
        .map(|(k, v)| KeyValue::new(k, v))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `ManualReader` that `/metrics` shares with the meter provider.
#[derive(Debug, Clone)]
struct Scrape(Arc<ManualReader>);

impl MetricReader for Scrape {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

/// One node's tracer and instruments.
///
/// Without OTLP the tracer is a no-op (spans cost an allocation and carry
/// the parent's context, so `traceparent` still propagates) and metrics are
/// only read by `/metrics`. With OTLP, spans go through a batch processor
/// and metrics through a periodic reader, each on its own thread.
/// [`shutdown`](Self::shutdown) flushes both; it blocks, so call it off the
/// async runtime.
pub struct Telemetry {
    tracer: BoxedTracer,
    tracer_provider: Option<SdkTracerProvider>,
    meter_provider: SdkMeterProvider,
    scrape: Scrape,
    metrics: Metrics,
    config: TelemetryConfig,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("otlp", &self.config.otlp)
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// From the process's `OTEL_*` variables.
    pub fn from_env() -> Result<Self, TelemetryError> {
        Self::new(TelemetryConfig::from_env()?)
    }

    /// From the process's `OTEL_*` variables, with `service.instance.id`
    /// set to `node` unless `OTEL_RESOURCE_ATTRIBUTES` names one: several
    /// nodes behind one collector stay apart.
    pub fn from_env_for_node(node: &str) -> Result<Self, TelemetryError> {
        Self::new(TelemetryConfig::from_env()?.with_instance(node))
    }

    /// Metrics for `/metrics` only; no spans recorded, nothing exported.
    pub fn disabled() -> Self {
        Self::new(TelemetryConfig {
            otlp: None,
            resource: resource(&|_| None),
        })
        .expect("telemetry without export builds")
    }

    /// The tracer and instruments `config` describes, with their OTLP exporters if any.
    pub fn new(config: TelemetryConfig) -> Result<Self, TelemetryError> {
        let resource = Resource::builder_empty()
            .with_attributes(config.resource.clone())
            .build();
        let scope = InstrumentationScope::builder("onceflow")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let otlp = config.otlp.as_ref();

        let scrape = Scrape(Arc::new(
            ManualReader::builder()
                .with_temporality(Temporality::Cumulative)
                .build(),
        ));
        let mut meters = SdkMeterProvider::builder()
            .with_resource(resource.clone())
            .with_reader(scrape.clone());
        if let Some(url) = otlp.and_then(|o| o.metrics.as_ref()) {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(url)
                .with_temporality(Temporality::Cumulative)
                .build()
                .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
            let interval = otlp.map_or(Duration::from_secs(60), |o| o.metric_interval);
            meters = meters.with_reader(
                PeriodicReader::builder(exporter)
                    .with_interval(interval)
                    .build(),
            );
        }
        let meter_provider = meters.build();
        let metrics = Metrics::new(&opentelemetry::metrics::MeterProvider::meter_with_scope(
            &meter_provider,
            scope.clone(),
        ));

        let (tracer, tracer_provider) = match otlp.and_then(|o| o.traces.as_ref()) {
            Some(url) => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary)
                    .with_endpoint(url)
                    .build()
                    .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
                let provider = SdkTracerProvider::builder()
                    .with_resource(resource)
                    .with_batch_exporter(exporter)
                    .build();
                let tracer = provider.tracer_with_scope(scope);
                (BoxedTracer::new(Box::new(tracer)), Some(provider))
            }
            None => (BoxedTracer::new(Box::new(NoopTracer::new())), None),
        };
        Ok(Telemetry {
            tracer,
            tracer_provider,
            meter_provider,
            scrape,
            metrics,
            config,
        })
    }

    /// The tracer every span of this node starts from.
    pub fn tracer(&self) -> &BoxedTracer {
        &self.tracer
    }

    /// The instruments the engine records into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Where OTLP goes, if anywhere.
    pub fn otlp(&self) -> Option<&OtlpConfig> {
        self.config.otlp.as_ref()
    }

    /// Every instrument, as Prometheus text.
    pub fn prometheus(&self) -> String {
        let mut rm = ResourceMetrics::default();
        match self.scrape.collect(&mut rm) {
            Ok(()) => crate::prometheus::encode(&rm),
            Err(e) => format!("# collecting metrics failed: {e}\n"),
        }
    }

    /// Exports what is buffered and stops the exporters. Blocks; call it off
    /// the async runtime (the exporters use a blocking HTTP client).
    pub fn shutdown(&self) -> Result<(), TelemetryError> {
        let mut problems = Vec::new();
        if let Some(tp) = &self.tracer_provider {
            if let Err(e) = tp.force_flush() {
                problems.push(format!("spans: {e}"));
            }
            let _ = tp.shutdown();
        }
        if self
            .config
            .otlp
            .as_ref()
            .is_some_and(|o| o.metrics.is_some())
        {
            if let Err(e) = self.meter_provider.force_flush() {
                problems.push(format!("metrics: {e}"));
            }
        }
        let _ = self.meter_provider.shutdown();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(TelemetryError::Flush(problems.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<TelemetryConfig, TelemetryError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TelemetryConfig::from_lookup(|k| vars.get(k).cloned())
    }

    fn service_name(c: &TelemetryConfig) -> String {
        c.resource
            .iter()
            .find(|kv| kv.key.as_str() == "service.name")
            .map(|kv| kv.value.to_string())
            .unwrap()
    }

    #[test]
    fn nothing_is_exported_without_an_endpoint() {
        let c = config(&[("OTEL_SERVICE_NAME", "x")]).unwrap();
        assert_eq!(c.otlp, None);
        assert_eq!(service_name(&c), "x");
    }

    #[test]
    fn the_base_endpoint_gets_signal_paths_and_signal_endpoints_are_verbatim() {
        let c = config(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h:4318/")]).unwrap();
        let o = c.otlp.unwrap();
        assert_eq!(o.traces.as_deref(), Some("http://h:4318/v1/traces"));
        assert_eq!(o.metrics.as_deref(), Some("http://h:4318/v1/metrics"));
        let c = config(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t/x"),
            ("OTEL_METRICS_EXPORTER", "none"),
        ])
        .unwrap();
        let o = c.otlp.unwrap();
        assert_eq!(o.traces.as_deref(), Some("http://t/x"));
        assert_eq!(o.metrics, None);
        assert_eq!(
            config(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h"),
                ("OTEL_SDK_DISABLED", "true")
            ])
            .unwrap()
            .otlp,
            None
        );
    }

    #[test]
    fn bad_settings_name_their_variable() {
        for (vars, variable) in [
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "h:4318")],
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ],
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h"),
                    ("OTEL_METRIC_EXPORT_INTERVAL", "soon"),
                ],
                "OTEL_METRIC_EXPORT_INTERVAL",
            ),
        ] {
            let e = config(&vars).unwrap_err().to_string();
            assert!(e.starts_with(variable), "{e}");
        }
    }

    #[test]
    fn the_node_is_the_service_instance_unless_one_is_given() {
        let c = config(&[]).unwrap().with_instance("node-a");
        assert!(c
            .resource
            .iter()
            .any(|kv| kv.key.as_str() == "service.instance.id" && kv.value.as_str() == "node-a"));
        let given = config(&[("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7")])
            .unwrap()
            .with_instance("node-a");
        let ids: Vec<String> = given
            .resource
            .iter()
            .filter(|kv| kv.key.as_str() == "service.instance.id")
            .map(|kv| kv.value.as_str().into_owned())
            .collect();
        assert_eq!(ids, ["pod-7"]);
    }

    #[test]
    fn resource_attributes_are_parsed_and_service_name_defaults() {
        let c = config(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment=prod,team=a%20b",
        )])
        .unwrap();
        assert_eq!(service_name(&c), "onceflow");
        assert!(c
            .resource
            .iter()
            .any(|kv| kv.key.as_str() == "team" && kv.value.to_string() == "a b"));
    }
}
