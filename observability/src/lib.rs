//! # onceflow-observability
//!
//! How onceflow is watched.
//!
//! - [`init_logging`]: `tracing-subscriber` logs, human by default
//!   (`ONCEFLOW_LOG_FORMAT=json` for JSON lines), filtered by `RUST_LOG`
//!   (default `info`). The filter belongs to the log layer only.
//! - [`Telemetry`]: one node's OpenTelemetry tracer and instruments. OTLP/HTTP
//!   export of spans and metrics when `OTEL_EXPORTER_OTLP_ENDPOINT` (or a
//!   per-signal endpoint) is set, honouring the standard `OTEL_*` variables;
//!   nothing leaves the process when it is not. The same instruments render
//!   as Prometheus text for `GET /metrics` ([`prometheus`]).
//! - [`names`]: every span, attribute and metric name, as constants.
//! - [`Metrics`]: the instruments, with helpers for the counted events.
//!
//! The engine creates the spans (a `job` span per attempt under the job's
//! stored trace context, a child per step) and records the metrics; this
//! crate only builds the pipeline and names things. The Grafana dashboard
//! and the Collector configuration live beside this crate
//! (`observability/grafana/`, `observability/collector.yaml`).

#![warn(missing_docs)]

pub mod metrics;
pub mod names;
pub mod prometheus;
mod telemetry;

pub use metrics::Metrics;
pub use telemetry::{OtlpConfig, Telemetry, TelemetryConfig, TelemetryError};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Installs the global log subscriber. Safe to call more than once (later calls do nothing).
pub fn init_logging() {
    init_logging_at("info");
}

/// [`init_logging`] with another default level than `info` when `RUST_LOG`
/// is unset (the demo keeps its table free of the engine's INFO lines).
pub fn init_logging_at(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let json = std::env::var("ONCEFLOW_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let layer = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let _ = tracing_subscriber::registry().with(layer).try_init();
}
