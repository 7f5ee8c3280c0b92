//! Spans and metrics of job attempts, on a node's [`Telemetry`].
//!
//! A job's trace is stored with the job at intake ([`crate::rules::traceparent`]). Each
//! attempt opens a `job` span whose parent is that stored context, so every
//! attempt, on any node, after any crash, lands in the same trace. Each step
//! is a child span of the attempt; the `traceparent` sent with a model,
//! webhook or tool request is that step's span. Names come from
//! [`onceflow_observability::names`].

use std::sync::Arc;
use std::time::Instant;

use onceflow_observability::names::*;
use onceflow_observability::{Metrics, Telemetry};
use opentelemetry::global::BoxedSpan;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::KeyValue;

use crate::rules::traceparent::TraceParent;

/// The OpenTelemetry context of a stored `traceparent` (a remote parent).
pub(crate) fn remote_context(tp: &TraceParent) -> opentelemetry::Context {
    let sc = SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        if tp.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        true,
        TraceState::default(),
    );
    opentelemetry::Context::new().with_remote_span_context(sc)
}

/// A span context as a [`TraceParent`], if it is valid.
pub(crate) fn trace_parent(sc: &SpanContext) -> Option<TraceParent> {
    sc.is_valid().then(|| TraceParent {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        sampled: sc.is_sampled(),
    })
}

/// One attempt's place in its job's trace, and the node's instruments.
#[derive(Debug, Clone)]
pub(crate) struct Scope {
    telemetry: Arc<Telemetry>,
    /// Holds the attempt's `job` span.
    cx: opentelemetry::Context,
    /// This attempt's span in the stored trace when spans are not recorded
    /// (a no-op tracer hands out the stored context itself).
    fallback: TraceParent,
    stored_span: [u8; 8],
}

impl Scope {
    /// Opens the `job` span of one attempt under the job's stored trace.
    pub(crate) fn job(
        telemetry: Arc<Telemetry>,
        trace: Option<TraceParent>,
        attributes: Vec<KeyValue>,
    ) -> Scope {
        let stored = trace.unwrap_or_else(TraceParent::new_root);
        let parent = remote_context(&stored);
        let span = telemetry
            .tracer()
            .span_builder(SPAN_JOB)
            .with_kind(SpanKind::Internal)
            .with_attributes(attributes)
            .start_with_context(telemetry.tracer(), &parent);
        Scope {
            cx: parent.with_span(span),
            telemetry,
            fallback: stored.child(),
            stored_span: stored.span_id,
        }
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        self.telemetry.metrics()
    }

    /// Starts a step span, child of the attempt.
    pub(crate) fn step(
        &self,
        name: &'static str,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
    ) -> StepSpan {
        let tracer = self.telemetry.tracer();
        let span = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(tracer, &self.cx);
        StepSpan {
            span,
            name,
            started: Instant::now(),
            telemetry: self.telemetry.clone(),
            // Each step (each send) has a span id of its own, recorded or not.
            fallback: self.fallback.child(),
            stored_span: self.stored_span,
            ended: false,
        }
    }

    /// Ends the `job` span with how the attempt ended.
    pub(crate) fn end_job(&self, outcome: &str, error: bool) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(JOB_OUTCOME, outcome.to_owned()));
        if error {
            span.set_status(Status::error(outcome.to_owned()));
        }
        span.end();
    }
}

/// A step's span; ending it also records the step's duration. Dropped
/// without [`end`](Self::end) (an error or a cancelled attempt), it ends as
/// `failed`.
pub(crate) struct StepSpan {
    span: BoxedSpan,
    name: &'static str,
    started: Instant,
    telemetry: Arc<Telemetry>,
    fallback: TraceParent,
    stored_span: [u8; 8],
    ended: bool,
}

/// Counts `n` jobs admitted, whatever their source (a submit, a batch's
/// item, a re-run, a child, a schedule's firing): `onceflow.jobs.submitted`
/// by workflow and outcome (`created`, or `existing` for one found again).
pub fn count_intake(telemetry: &Telemetry, workflow: &str, outcome: &'static str, n: u64) {
    telemetry.metrics().jobs_submitted.add(
        n,
        &[
            KeyValue::new(
                onceflow_observability::names::WORKFLOW_NAME,
                workflow.to_owned(),
            ),
            KeyValue::new(onceflow_observability::names::SUBMIT_OUTCOME, outcome),
        ],
    );
}

impl StepSpan {
    /// The `traceparent` for this step's outgoing request.
    pub(crate) fn traceparent(&self) -> String {
        self.trace().to_string()
    }

    /// The trace context this step's work continues (a request's, a
    /// child's).
    pub(crate) fn trace(&self) -> TraceParent {
        trace_parent(self.span.span_context())
            .filter(|tp| tp.span_id != self.stored_span)
            .unwrap_or(self.fallback)
    }

    /// Counts a job this step made, as intake counts every job it admits
    /// (`onceflow.jobs.submitted`, by workflow and outcome).
    pub(crate) fn count_intake(&self, workflow: &str, outcome: &'static str) {
        count_intake(&self.telemetry, workflow, outcome, 1);
    }

    pub(crate) fn set(&mut self, kv: KeyValue) {
        self.span.set_attribute(kv);
    }

    pub(crate) fn end(mut self, outcome: &'static str) {
        self.finish(outcome);
    }

    fn finish(&mut self, outcome: &'static str) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.span.set_attribute(KeyValue::new(OUTCOME, outcome));
        if outcome == OUTCOME_FAILED {
            self.span.set_status(Status::error(outcome));
        }
        self.span.end();
        self.telemetry.metrics().step_duration.record(
            self.started.elapsed().as_secs_f64(),
            &[
                KeyValue::new(STEP, self.name),
                KeyValue::new(OUTCOME, outcome),
            ],
        );
    }
}

impl Drop for StepSpan {
    fn drop(&mut self) {
        self.finish(OUTCOME_FAILED);
    }
}
