//! The Grafana dashboard asks only for series that onceflow produces: every
//! `onceflow_*` name in its queries is one `/metrics` renders. The
//! operations guide's metric table lists exactly the families rendered.

use std::collections::BTreeSet;

use onceflow_observability::Telemetry;
use opentelemetry::KeyValue;

/// The metric families and label names `/metrics` shows once every
/// instrument has a value, recorded the way the engine records it.
fn exported() -> (BTreeSet<String>, BTreeSet<String>) {
    use onceflow_observability::names::*;
    let t = Telemetry::disabled();
    let m = t.metrics();
    m.jobs_submitted.add(
        1,
        &[
            KeyValue::new(WORKFLOW_NAME, "completion"),
            KeyValue::new(SUBMIT_OUTCOME, "created"),
        ],
    );
    m.transition("acked");
    m.model_call("performed");
    m.tokens(Some(1), Some(1), false);
    m.delivery("delivered");
    m.tool("performed");
    m.mcp_call("shop", "performed");
    m.lease_takeovers.add(1, &[]);
    m.actors_in_flight.add(1, &[]);
    m.jobs.record(1, &[KeyValue::new("onceflow.state", "dead")]);
    m.jobs_unrunnable.record(1, &[]);
    m.budget_spent.record(1, &[KeyValue::new(TOKEN, "tenant")]);
    m.budget_limit.record(2, &[KeyValue::new(TOKEN, "tenant")]);
    m.step_duration.record(
        0.1,
        &[
            KeyValue::new(STEP, "ack"),
            KeyValue::new(OUTCOME, "performed"),
        ],
    );
    m.throttled("openai", "gpt-4o");
    m.limit_wait("openai", "gpt-4o", std::time::Duration::from_millis(5));
    m.limit_saturation("openai", "gpt-4o", 0.5);
    m.stream("gpt-4o", std::time::Duration::from_millis(200), Some(40.0));
    let text = t.prometheus();
    let families = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect();
    let labels = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| Some(l.split_once('{')?.1.split_once('}')?.0.to_owned()))
        .flat_map(|set| {
            set.split(',')
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect();
    (families, labels)
}

#[test]
fn every_dashboard_query_names_a_metric_onceflow_exports() {
    let (families, labels) = exported();
    // 19 of onceflow's own, and `target_info` (the node's identity).
    assert_eq!(families.len(), 20, "{families:?}");
    assert!(families.contains("target_info"), "{families:?}");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/grafana/onceflow-dashboard.json"
    ))
    .unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    collect(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut used = BTreeSet::new();
    for expr in &exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|t| t.starts_with("onceflow_") || t.starts_with("gen_ai_"))
        {
            if labels.contains(name) {
                continue;
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(*f)))
                .unwrap_or(name);
            assert!(
                families.contains(family),
                "the dashboard queries {name}, which onceflow does not export \
                 ({families:?}, labels {labels:?})"
            );
            used.insert(family.to_owned());
        }
    }
    // `target_info` names the node; it is a label source, not a panel.
    let onceflow: BTreeSet<String> = families
        .iter()
        .filter(|f| f.as_str() != "target_info")
        .cloned()
        .collect();
    assert_eq!(used, onceflow, "every metric has a panel");
}

fn collect(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
        _ => {}
    }
}

/// A fresh node (nothing happened yet) already exports every counter and
/// gauge the dashboard queries, at zero: `rate()` and `increase()` then see
/// the first dead delivery, the first takeover, the first retry.
#[test]
fn a_fresh_node_exports_every_dashboard_series_at_zero() {
    let t = Telemetry::disabled();
    t.metrics().zero(&["completion", "agent"]);
    let text = t.prometheus();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/grafana/onceflow-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    collect(&dashboard, &mut exprs);
    let mut checked = 0;
    for expr in &exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|t| t.starts_with("onceflow_"))
        {
            // The step-duration histogram has no meaningful zero; the
            // provider-limit series are per provider and model, which a node
            // learns from its first limited call; the budgets' are per token
            // with a budget, read from the database; the MCP calls' are per
            // configured server, from its first call; label names
            // (`onceflow_state="…"`) are not series.
            const LABELS: [&str; 7] = [
                "onceflow_mcp_server",
                "onceflow_step",
                "onceflow_state",
                "onceflow_outcome",
                "onceflow_submit_outcome",
                "onceflow_retry",
                "onceflow_token",
            ];
            if name.starts_with("onceflow_step_duration")
                || name.starts_with("onceflow_limit_")
                || name.starts_with("onceflow_budget_")
                || name.starts_with("onceflow_stream_")
                || name.starts_with("onceflow_provider_throttled")
                || name.starts_with("onceflow_mcp_calls")
                || LABELS.contains(&name)
            {
                continue;
            }
            let present = text
                .lines()
                .filter(|l| !l.starts_with('#'))
                .any(|l| l.starts_with(name) && l.trim_end().ends_with(" 0"));
            assert!(
                present,
                "{name} is not exported at zero on a fresh node:\n{text}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "{checked}");
    // The series a panel filters on are there before anything happens.
    for series in [
        "onceflow_deliveries_total{onceflow_outcome=\"dead\"",
        "onceflow_lease_takeovers_total",
        "onceflow_model_tokens_total{gen_ai_token_type=\"input\",onceflow_retry=\"true\"",
        "onceflow_jobs_submitted_total{onceflow_submit_outcome=\"created\",workflow_name=\"agent\"",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
}

/// The guide's metric table (docs/guide/operations.md) names every family
/// `/metrics` renders, and nothing else.
#[test]
fn the_guides_metric_table_matches_what_metrics_renders() {
    let guide = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/guide/operations.md"
    ))
    .unwrap();
    let listed: BTreeSet<String> = guide
        .lines()
        .filter(|l| l.starts_with("| `onceflow."))
        .filter_map(|l| Some(l.split_once("→ `")?.1.split_once('`')?.0.to_owned()))
        .chain(
            guide
                .lines()
                .filter(|l| l.starts_with("| `target_info`"))
                .map(|_| "target_info".to_owned()),
        )
        .collect();
    let (families, _) = exported();
    assert_eq!(listed, families);
    // And `exported()` leaves no instrument out: the guide's OpenTelemetry
    // names are every `METRIC_*` name onceflow defines.
    let names =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/names.rs")).unwrap();
    let defined: BTreeSet<String> = names
        .lines()
        .filter(|l| l.starts_with("pub const METRIC_"))
        .filter_map(|l| Some(l.split_once("= \"")?.1.split_once('"')?.0.to_owned()))
        .collect();
    let in_guide: BTreeSet<String> = guide
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| Some(l.split_once("` → `")?.0.to_owned()))
        .collect();
    assert_eq!(in_guide, defined, "every instrument in the guide");
}
