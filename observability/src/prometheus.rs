//! Prometheus text exposition (format 0.0.4) of collected OpenTelemetry
//! metrics, for `GET /metrics`.
//!
//! Names follow the OpenTelemetry-to-Prometheus conventions: characters
//! outside `[a-zA-Z0-9_]` become `_`, a unit of seconds adds `_seconds`,
//! monotonic sums end in `_total`; up-down counters and gauges are gauges.

use std::fmt::{Display, Write};

use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};

/// Renders every metric in `rm`, after `target_info`: the resource's
/// attributes (`service.name`, `service.instance.id` = the node's name, …)
/// as labels, so a direct scrape says which node answered.
pub fn encode(rm: &ResourceMetrics) -> String {
    let mut out = String::new();
    let resource: Vec<KeyValue> = rm
        .resource()
        .iter()
        .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
        .collect();
    if !resource.is_empty() {
        out.push_str("# HELP target_info Target metadata\n# TYPE target_info gauge\n");
        sample(&mut out, "target_info", resource.iter(), None, 1);
    }
    for scope in rm.scope_metrics() {
        for metric in scope.metrics() {
            match metric.data() {
                AggregatedMetrics::F64(data) => write_metric(&mut out, metric, data),
                AggregatedMetrics::U64(data) => write_metric(&mut out, metric, data),
                AggregatedMetrics::I64(data) => write_metric(&mut out, metric, data),
            }
        }
    }
    out
}

/// The Prometheus name of an OpenTelemetry metric.
pub fn metric_name(name: &str, unit: &str, monotonic_sum: bool) -> String {
    let mut n = sanitize(name);
    if unit == "s" && !n.ends_with("_seconds") {
        n.push_str("_seconds");
    }
    if monotonic_sum {
        n.push_str("_total");
    }
    n
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn write_metric<T: Display + Copy>(out: &mut String, metric: &Metric, data: &MetricData<T>) {
    let (kind, monotonic) = match data {
        MetricData::Sum(sum) if sum.is_monotonic() => ("counter", true),
        MetricData::Sum(_) | MetricData::Gauge(_) => ("gauge", false),
        MetricData::Histogram(_) => ("histogram", false),
        // Not used by onceflow; skipped rather than misrendered.
        MetricData::ExponentialHistogram(_) => return,
    };
    let name = metric_name(metric.name(), metric.unit(), monotonic);
    let _ = writeln!(out, "# HELP {name} {}", escape_help(metric.description()));
    let _ = writeln!(out, "# TYPE {name} {kind}");
    match data {
        MetricData::Sum(sum) => {
            for p in sum.data_points() {
                sample(out, &name, p.attributes(), None, p.value());
            }
        }
        MetricData::Gauge(gauge) => {
            for p in gauge.data_points() {
                sample(out, &name, p.attributes(), None, p.value());
            }
        }
        MetricData::Histogram(h) => {
            for p in h.data_points() {
                let attrs: Vec<&KeyValue> = p.attributes().collect();
                let mut cumulative = 0u64;
                let bounds: Vec<f64> = p.bounds().collect();
                for (i, count) in p.bucket_counts().enumerate() {
                    cumulative += count;
                    let le = bounds
                        .get(i)
                        .map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
                    sample(
                        out,
                        &format!("{name}_bucket"),
                        attrs.iter().copied(),
                        Some(("le", &le)),
                        cumulative,
                    );
                }
                sample(
                    out,
                    &format!("{name}_sum"),
                    attrs.iter().copied(),
                    None,
                    p.sum(),
                );
                sample(
                    out,
                    &format!("{name}_count"),
                    attrs.iter().copied(),
                    None,
                    p.count(),
                );
            }
        }
        MetricData::ExponentialHistogram(_) => {}
    }
}

fn sample<'a>(
    out: &mut String,
    name: &str,
    attrs: impl Iterator<Item = &'a KeyValue>,
    extra: Option<(&str, &str)>,
    value: impl Display,
) {
    let mut labels: Vec<(String, String)> = attrs
        .map(|kv| (sanitize(kv.key.as_str()), kv.value.to_string()))
        .collect();
    labels.sort();
    if let Some((k, v)) = extra {
        labels.push((k.to_owned(), v.to_owned()));
    }
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{k}=\"{}\"", escape_label(v));
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_prometheus_conventions() {
        assert_eq!(
            metric_name("onceflow.model.calls", "", true),
            "onceflow_model_calls_total"
        );
        assert_eq!(
            metric_name("onceflow.step.duration", "s", false),
            "onceflow_step_duration_seconds"
        );
        assert_eq!(metric_name("onceflow.jobs", "", false), "onceflow_jobs");
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
