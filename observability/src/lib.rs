//! # onceflow-observability
//!
//! Logging set-up for onceflow: `tracing-subscriber` with a human format by
//! default (`ONCEFLOW_LOG_FORMAT=json` for JSON lines), filtered by `RUST_LOG`
//! (default `info`). The filter applies to the log layer only, so adding more
//! layers later does not starve them.

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Installs the global subscriber. Safe to call more than once (later calls do nothing).
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
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
