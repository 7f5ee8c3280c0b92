//! The instruments onceflow records, created once per [`Telemetry`](crate::Telemetry).

use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, UpDownCounter};
use opentelemetry::KeyValue;

use crate::names::*;

/// Every job state's stored name (`onceflow.state` values).
const STATES: &[&str] = &[
    "received",
    "generated",
    "persisted",
    "claimed",
    "delivered",
    "acked",
    "dead",
    "cancelled",
];

/// Step durations from 1 ms to 2 minutes (model calls are slow).
const DURATION_BOUNDS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Every instrument; recording is a few atomic operations.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// [`METRIC_JOBS_SUBMITTED`]: jobs offered to intake.
    pub jobs_submitted: Counter<u64>,
    /// [`METRIC_TRANSITIONS`]: checkpoints committed, by state reached.
    pub transitions: Counter<u64>,
    /// [`METRIC_MODEL_CALLS`]: model calls by outcome.
    pub model_calls: Counter<u64>,
    /// [`METRIC_MODEL_TOKENS`]: tokens the provider reported.
    pub model_tokens: Counter<u64>,
    /// [`METRIC_DELIVERIES`]: webhook deliveries by outcome.
    pub deliveries: Counter<u64>,
    /// [`METRIC_TOOL_EXECUTIONS`]: tool executions by outcome.
    pub tool_executions: Counter<u64>,
    /// [`METRIC_MCP_CALLS`]: MCP tool calls by server and outcome.
    pub mcp_calls: Counter<u64>,
    /// [`METRIC_LEASE_TAKEOVERS`]: jobs resumed after another attempt's lease expired.
    pub lease_takeovers: Counter<u64>,
    /// [`METRIC_ACTORS_IN_FLIGHT`]: job actors running on this node.
    pub actors_in_flight: UpDownCounter<i64>,
    /// [`METRIC_JOBS`]: live jobs by state, and dead jobs.
    pub jobs: Gauge<u64>,
    /// [`METRIC_JOBS_UNRUNNABLE`]: live jobs whose workflow this node does not register.
    pub jobs_unrunnable: Gauge<u64>,
    /// [`METRIC_BUDGET_SPENT`]: model tokens spent today, by token (tokens with a budget).
    pub budget_spent: Gauge<u64>,
    /// [`METRIC_BUDGET_LIMIT`]: daily budgets of model tokens, by token.
    pub budget_limit: Gauge<u64>,
    /// [`METRIC_STEP_DURATION`]: step durations, in seconds.
    pub step_duration: Histogram<f64>,
    /// [`METRIC_PROVIDER_THROTTLED`]: 429s, by provider and model.
    pub provider_throttled: Counter<u64>,
    /// [`METRIC_LIMIT_WAIT`]: time waited for a provider limit, in seconds.
    pub limit_wait: Histogram<f64>,
    /// [`METRIC_LIMIT_SATURATION`]: the share of a provider limit in use.
    pub limit_saturation: Gauge<f64>,
    /// [`METRIC_STREAM_TTFT`]: time to a streamed answer's first token.
    pub stream_ttft: Histogram<f64>,
    /// [`METRIC_STREAM_TOKENS_PER_SECOND`]: a streamed answer's pace.
    pub stream_tokens_per_second: Histogram<f64>,
}

impl Metrics {
    pub(crate) fn new(meter: &Meter) -> Self {
        Metrics {
            jobs_submitted: meter
                .u64_counter(METRIC_JOBS_SUBMITTED)
                .with_description("Jobs offered to intake")
                .build(),
            transitions: meter
                .u64_counter(METRIC_TRANSITIONS)
                .with_description("Checkpoints committed, by the state reached")
                .build(),
            model_calls: meter
                .u64_counter(METRIC_MODEL_CALLS)
                .with_description("Model calls by outcome")
                .build(),
            model_tokens: meter
                .u64_counter(METRIC_MODEL_TOKENS)
                .with_description("Tokens reported by the provider")
                .with_unit("{token}")
                .build(),
            deliveries: meter
                .u64_counter(METRIC_DELIVERIES)
                .with_description("Completion webhook deliveries by outcome")
                .build(),
            tool_executions: meter
                .u64_counter(METRIC_TOOL_EXECUTIONS)
                .with_description("Tool executions by outcome")
                .build(),
            mcp_calls: meter
                .u64_counter(METRIC_MCP_CALLS)
                .with_description("MCP tool calls by server and outcome")
                .build(),
            lease_takeovers: meter
                .u64_counter(METRIC_LEASE_TAKEOVERS)
                .with_description("Jobs resumed after another attempt's lease expired")
                .build(),
            actors_in_flight: meter
                .i64_up_down_counter(METRIC_ACTORS_IN_FLIGHT)
                .with_description("Job actors running on this node")
                .build(),
            jobs: meter
                .u64_gauge(METRIC_JOBS)
                .with_description("Jobs in the database by state")
                .build(),
            jobs_unrunnable: meter
                .u64_gauge(METRIC_JOBS_UNRUNNABLE)
                .with_description("Live jobs whose workflow is not registered on this node")
                .build(),
            budget_spent: meter
                .u64_gauge(METRIC_BUDGET_SPENT)
                .with_description("Model tokens a token with a daily budget spent today (UTC)")
                .build(),
            budget_limit: meter
                .u64_gauge(METRIC_BUDGET_LIMIT)
                .with_description("A token's daily budget of model tokens")
                .build(),
            step_duration: meter
                .f64_histogram(METRIC_STEP_DURATION)
                .with_description("Duration of one step of a job")
                .with_unit("s")
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build(),
            provider_throttled: meter
                .u64_counter(METRIC_PROVIDER_THROTTLED)
                .with_description("Model requests the provider answered 429, by provider and model")
                .build(),
            limit_wait: meter
                .f64_histogram(METRIC_LIMIT_WAIT)
                .with_description("Time a model call waited for a provider limit's slot")
                .with_unit("s")
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build(),
            limit_saturation: meter
                .f64_gauge(METRIC_LIMIT_SATURATION)
                .with_description(
                    "Share of a provider limit in use at the last admission (1 while calls wait)",
                )
                .build(),
            stream_ttft: meter
                .f64_histogram(METRIC_STREAM_TTFT)
                .with_description("Time from a streamed model call's send to its first token")
                .with_unit("s")
                .with_boundaries(DURATION_BOUNDS.to_vec())
                .build(),
            stream_tokens_per_second: meter
                .f64_histogram(METRIC_STREAM_TOKENS_PER_SECOND)
                .with_description(
                    "Output tokens per second of a streamed answer, after its first token",
                )
                .with_boundaries(vec![
                    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
                ])
                .build(),
        }
    }

    /// Counts a 429 from `provider` for `model`.
    pub fn throttled(&self, provider: &str, model: &str) {
        self.provider_throttled.add(
            1,
            &[
                KeyValue::new(GEN_AI_PROVIDER, provider.to_owned()),
                KeyValue::new(GEN_AI_REQUEST_MODEL, model.to_owned()),
            ],
        );
    }

    /// Records how long a call of `provider`'s `model` waited for a slot.
    pub fn limit_wait(&self, provider: &str, model: &str, waited: std::time::Duration) {
        self.limit_wait.record(
            waited.as_secs_f64(),
            &[
                KeyValue::new(GEN_AI_PROVIDER, provider.to_owned()),
                KeyValue::new(GEN_AI_REQUEST_MODEL, model.to_owned()),
            ],
        );
    }

    /// Records the share of `provider`'s `model` limit in use (1: calls wait).
    pub fn limit_saturation(&self, provider: &str, model: &str, share: f64) {
        self.limit_saturation.record(
            share,
            &[
                KeyValue::new(GEN_AI_PROVIDER, provider.to_owned()),
                KeyValue::new(GEN_AI_REQUEST_MODEL, model.to_owned()),
            ],
        );
    }

    /// Records a streamed answer of `model`: its time to first token and,
    /// when usage was reported, its output tokens per second after it.
    pub fn stream(&self, model: &str, ttft: std::time::Duration, tokens_per_second: Option<f64>) {
        let attrs = [KeyValue::new(GEN_AI_REQUEST_MODEL, model.to_owned())];
        self.stream_ttft.record(ttft.as_secs_f64(), &attrs);
        if let Some(tps) = tokens_per_second {
            self.stream_tokens_per_second.record(tps, &attrs);
        }
    }

    /// Records every counter's known label sets at zero (and the gauges at
    /// zero), so a scrape of a fresh node shows every series: `rate()` and
    /// `increase()` then see the first increment, instead of a series that
    /// appears already at 1. `workflows` are the registered workflow names.
    pub fn zero(&self, workflows: &[&str]) {
        for w in workflows {
            for outcome in ["created", "existing"] {
                self.jobs_submitted.add(
                    0,
                    &[
                        KeyValue::new(WORKFLOW_NAME, w.to_string()),
                        KeyValue::new(SUBMIT_OUTCOME, outcome),
                    ],
                );
            }
        }
        for state in STATES {
            self.transitions.add(0, &[KeyValue::new(STATE, *state)]);
            // The gauge counts live and dead jobs, not the finished ones kept
            // for the retention window (see `METRIC_JOBS`).
            if !matches!(*state, "acked" | "cancelled") {
                self.jobs.record(0, &[KeyValue::new(STATE, *state)]);
            }
        }
        for outcome in [
            OUTCOME_PERFORMED,
            OUTCOME_REPLAYED,
            OUTCOME_RETRIED,
            OUTCOME_FAILED,
        ] {
            self.model_calls.add(0, &[KeyValue::new(OUTCOME, outcome)]);
            self.tool_executions
                .add(0, &[KeyValue::new(OUTCOME, outcome)]);
        }
        for kind in ["input", "output"] {
            for retry in [false, true] {
                self.model_tokens.add(
                    0,
                    &[
                        KeyValue::new(GEN_AI_TOKEN_TYPE, kind),
                        KeyValue::new(RETRY, retry),
                    ],
                );
            }
        }
        for outcome in [
            OUTCOME_DELIVERED,
            OUTCOME_RETRIED,
            OUTCOME_DUPLICATE_SUPPRESSED,
            OUTCOME_DEAD,
        ] {
            self.deliveries.add(0, &[KeyValue::new(OUTCOME, outcome)]);
        }
        self.lease_takeovers.add(0, &[]);
        self.actors_in_flight.add(0, &[]);
        self.jobs_unrunnable.record(0, &[]);
    }

    /// Counts one model call by outcome.
    pub fn model_call(&self, outcome: &'static str) {
        self.model_calls.add(1, &[KeyValue::new(OUTCOME, outcome)]);
    }

    /// Counts the tokens of one answered model request; `retry` when the
    /// request repeated an earlier send of the same key.
    pub fn tokens(&self, input: Option<i32>, output: Option<i32>, retry: bool) {
        for (kind, n) in [("input", input), ("output", output)] {
            if let Some(n) = n.and_then(|n| u64::try_from(n).ok()) {
                self.model_tokens.add(
                    n,
                    &[
                        KeyValue::new(GEN_AI_TOKEN_TYPE, kind),
                        KeyValue::new(RETRY, retry),
                    ],
                );
            }
        }
    }

    /// Counts one delivery event by outcome.
    pub fn delivery(&self, outcome: &'static str) {
        self.deliveries.add(1, &[KeyValue::new(OUTCOME, outcome)]);
    }

    /// Counts one tool execution by outcome.
    pub fn tool(&self, outcome: &'static str) {
        self.tool_executions
            .add(1, &[KeyValue::new(OUTCOME, outcome)]);
    }

    /// Counts one MCP tool call by server (a configured name) and outcome.
    pub fn mcp_call(&self, server: &str, outcome: &'static str) {
        self.mcp_calls.add(
            1,
            &[
                KeyValue::new(MCP_SERVER, server.to_owned()),
                KeyValue::new(OUTCOME, outcome),
            ],
        );
    }

    /// Counts one committed checkpoint reaching `state`.
    pub fn transition(&self, state: &'static str) {
        self.transitions.add(1, &[KeyValue::new(STATE, state)]);
    }
}
