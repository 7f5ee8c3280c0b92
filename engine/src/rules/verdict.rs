//! What a failure means for a job, decided with no I/O.
//!
//! [`on_failure`] maps a failed step (its [`StepError`], the job's state,
//! its retry policy and attempt) to a [`Verdict`]; [`on_send_failure`]
//! decides what a failed webhook send does under the workflow's delivery
//! policy. The job actor carries the verdict out (`reschedule`, `kill`,
//! `fail_delivery`); these functions are unit-tested over their whole
//! matrix in microseconds, and the crash-point explorer covers the effects.
//!
//! Beside them: [`decide_send`], what an attempt does with a send from its
//! journal row alone (the model-call, tool-call and outbox journals share
//! it); [`on_call_failure`] and [`on_tool_error`], what a failed model call
//! or tool call means for the step (retry, throttled, permanent); and
//! [`OutboxStatus`], the final state a verdict gives an outbox row.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::StepError;
use crate::faults::Injected;
use crate::rules::failure::Failure;
use crate::rules::lifecycle::JobState;
use crate::rules::quota::CallEnd;
use crate::rules::retry::RetryPolicy;

/// What happens to a completion webhook whose request may have been sent but
/// whose outcome was never recorded (a crash mid-request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryPolicy {
    /// Send again with the same `Idempotency-Key`/`webhook-id`; the consumer
    /// drops the repeat. The default.
    AtLeastOnce,
    /// Never send twice: the outbox row becomes `unknown` and the job is
    /// dead-lettered for a human.
    AtMostOnce,
}

/// Attempts after which a transient-looking store error that never clears
/// ends the job: with the in-place budget of 30 s each, about 25 minutes of
/// a database that leases the job yet refuses the same statement.
pub const STORE_ATTEMPTS: u32 = 50;

/// What happens to a job after a step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Write nothing more: the lease is gone (another attempt owns the job)
    /// or the attempt crashed (its lease expires and it is resumed).
    Stop,
    /// Release the lease and run the job again after the policy's backoff
    /// for the `attempt`-th failure, at least `retry_after`.
    Retry {
        /// Which failure this is (1-based): it sets the backoff.
        attempt: u32,
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<Duration>,
    },
    /// Dead-letter the job with this reason.
    Dead {
        /// The job's dead reason.
        reason: String,
    },
}

/// The verdict on a step that failed with `error` while the job was in
/// `state`, under `policy`; `store_failures` counts the job's earlier
/// attempts that ended on a database error (leases, redrives and takeovers
/// do not count).
pub fn on_failure(
    error: &StepError,
    state: JobState,
    policy: &RetryPolicy,
    store_failures: u32,
) -> Verdict {
    // This failure included.
    let store_failures = store_failures.saturating_add(1);
    match error {
        // A wait released the job in its own commit: nothing more to write.
        StepError::LeaseLost
        | StepError::Draining
        | StepError::Injected(Injected::Crash(_))
        | StepError::Waiting { .. } => Verdict::Stop,
        StepError::Retry {
            attempt,
            retry_after,
            ..
        } => {
            if policy.exhausted(*attempt) {
                Verdict::Dead {
                    reason: format!("retry budget exhausted after {attempt} sends"),
                }
            } else {
                Verdict::Retry {
                    attempt: *attempt,
                    retry_after: *retry_after,
                }
            }
        }
        StepError::Injected(Injected::Fail(_)) => Verdict::Retry {
            attempt: 1,
            retry_after: None,
        },
        // The statement was already retried in place for the store's whole
        // budget: the database is down or overloaded. The job is not the
        // problem, so it is never dead-lettered for it; it runs again
        // later, backing off with its store failures.
        StepError::Store(e) if e.is_retryable() && store_failures < STORE_ATTEMPTS => {
            Verdict::Retry {
                attempt: store_failures,
                retry_after: None,
            }
        }
        // Still failing after this many attempts, each retrying in place for
        // the store's whole budget, while the database answers well enough
        // to lease the job: the statement itself is refused (bad data the
        // driver cannot name), not the database down.
        StepError::Store(e) if e.is_retryable() => Verdict::Dead {
            reason: format!("a database statement kept failing over {store_failures} attempts"),
        },
        StepError::Permanent { reason, .. } => Verdict::Dead {
            reason: reason.clone(),
        },
        StepError::Store(_) | StepError::InvalidInput(_) | StepError::Serialize(_) => {
            Verdict::Dead {
                reason: format!("permanent error in state {state}"),
            }
        }
    }
}

/// A failed webhook send, as far as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendFailure {
    /// The request may have reached the consumer (anything but a refused
    /// connection).
    pub may_have_arrived: bool,
    /// Network errors, timeouts, 408, 429 and 5xx.
    pub retryable: bool,
    /// Sends of this event so far, this one included.
    pub sends: u32,
}

/// What a failed send does to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendVerdict {
    /// Record the failure and retry later under the same key.
    Retry,
    /// At-most-once and it may have arrived: close the row `unknown` and the
    /// job `dead`, in the same transaction as the failure's record.
    Unknown,
    /// Refused for good (a 4xx other than 408/429): the row and job `dead`.
    Refused,
    /// The retry budget is spent: the row and job `dead`.
    BudgetSpent,
}

impl SendVerdict {
    /// The outbox row's final status and the job's dead reason, when the
    /// verdict ends the job.
    pub fn closes(self, error_code: &str, sends: u32) -> Option<(OutboxStatus, String)> {
        match self {
            SendVerdict::Retry => None,
            SendVerdict::Unknown => Some((
                OutboxStatus::Unknown,
                "delivery outcome unknown (at-most-once): the send failed after it left".into(),
            )),
            SendVerdict::Refused => Some((
                OutboxStatus::Dead,
                format!("the webhook consumer refused the delivery permanently ({error_code})"),
            )),
            SendVerdict::BudgetSpent => Some((
                OutboxStatus::Dead,
                format!("retry budget exhausted after {sends} sends"),
            )),
        }
    }
}

/// An outbox row's status (the SQL enum `outbox_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxStatus {
    /// Claimed, not yet delivered.
    Claimed,
    /// The consumer answered 2xx.
    Delivered,
    /// At-most-once, and a send left without its outcome recorded.
    Unknown,
    /// Refused for good or out of budget.
    Dead,
}

impl OutboxStatus {
    /// The value of the SQL enum `outbox_status`.
    pub fn as_sql(self) -> &'static str {
        match self {
            OutboxStatus::Claimed => "claimed",
            OutboxStatus::Delivered => "delivered",
            OutboxStatus::Unknown => "unknown",
            OutboxStatus::Dead => "dead",
        }
    }
}

/// What a failed outbound call — a model call, or a tool's POST through
/// `post_json` — means for the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallVerdict {
    /// Run the step again later, no sooner than `retry_after` when the
    /// server named one.
    Retry {
        /// The server's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// The provider is over its limit (429, or Anthropic's 529 "overloaded"):
    /// run the step again later, and the key's learned window halves.
    Throttled {
        /// The server's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// Refused for good: the step fails and the job dies.
    Permanent,
}

impl CallVerdict {
    /// Whether the step runs again.
    pub fn retries(self) -> bool {
        !matches!(self, CallVerdict::Permanent)
    }

    /// When the step may run again at the earliest, if the server said.
    pub fn retry_after(self) -> Option<Duration> {
        match self {
            CallVerdict::Retry { retry_after } | CallVerdict::Throttled { retry_after } => {
                retry_after
            }
            CallVerdict::Permanent => None,
        }
    }

    /// How the call ended, for the provider's learned window.
    pub fn call_end(self) -> CallEnd {
        match self {
            CallVerdict::Throttled { .. } => CallEnd::Throttled,
            CallVerdict::Retry { .. } | CallVerdict::Permanent => CallEnd::Other,
        }
    }
}

/// The verdict on a model call or tool POST that failed with `failure`:
/// 429 and 529 throttle; 408, other 5xx, a connection that failed, an
/// answer lost or unreadable retry; anything else (4xx, a refused URL, an
/// answer over its cap) is permanent.
pub fn on_call_failure(failure: &Failure) -> CallVerdict {
    let retry_after = failure.retry_after();
    match failure.status() {
        Some(429 | 529) => CallVerdict::Throttled { retry_after },
        _ if failure.is_retryable() => CallVerdict::Retry { retry_after },
        _ => CallVerdict::Permanent,
    }
}

/// The verdict on a tool whose own code failed with `error`: retryable
/// errors (a `StepError::Retry`, a transient store error, an injected
/// failure) run the step again; the rest are permanent, and the ledger
/// records the call as failed for good.
pub fn on_tool_error(error: &StepError) -> CallVerdict {
    match error {
        StepError::Retry { retry_after, .. } => CallVerdict::Retry {
            retry_after: *retry_after,
        },
        e if e.is_retryable() => CallVerdict::Retry { retry_after: None },
        _ => CallVerdict::Permanent,
    }
}

/// A send in flight that this attempt must wait for: one made under the same
/// lease epoch (a concurrent attempt sharing the lease) that has not expired.
/// A send from an earlier epoch belongs to an attempt whose lease was taken
/// over; the taker resends under the same key.
fn in_flight(
    until: Option<DateTime<Utc>>,
    epoch: Option<i64>,
    now: DateTime<Utc>,
    fence_epoch: i64,
) -> Option<DateTime<Utc>> {
    until.filter(|u| *u > now && epoch == Some(fence_epoch))
}

/// How a journal treats a send whose outcome was never recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    /// Send it again under the same key (the receiver drops the repeat).
    AtLeastOnce,
    /// Never send it again: its outcome is unknown and needs a human.
    AtMostOnce,
}

/// A journal row of a send (model call, tool call, outbox row) as an
/// attempt finds it, after its identity (key, request hash, tool-call id)
/// matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRow {
    /// The outcome is recorded (completed, delivered).
    pub done: bool,
    /// Set when a send started and cleared when its failure was recorded.
    pub in_flight_until: Option<DateTime<Utc>>,
    /// The lease epoch of the attempt that started that send.
    pub in_flight_epoch: Option<i64>,
    /// The database's clock when the row was read.
    pub now: DateTime<Utc>,
}

/// What an attempt does with a send, decided from its journal row alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendDecision {
    /// The outcome is journaled: return it, send nothing.
    Done,
    /// An attempt sharing this lease has it in flight until then: wait.
    Wait {
        /// When the in-flight mark lapses.
        until: DateTime<Utc>,
    },
    /// Send (again) under the same key.
    Send,
    /// At-most-once and an earlier send's outcome was never recorded: it may
    /// have arrived, so it is never sent again.
    Unknown,
}

/// The one decision the model-call, tool-call and outbox journals share.
pub fn decide_send(row: &SendRow, fence_epoch: i64, mode: SendMode) -> SendDecision {
    if row.done {
        return SendDecision::Done;
    }
    if let Some(until) = in_flight(
        row.in_flight_until,
        row.in_flight_epoch,
        row.now,
        fence_epoch,
    ) {
        return SendDecision::Wait { until };
    }
    match (mode, row.in_flight_until) {
        (SendMode::AtMostOnce, Some(_)) => SendDecision::Unknown,
        (SendMode::AtMostOnce, None) | (SendMode::AtLeastOnce, _) => SendDecision::Send,
    }
}

/// The verdict on a failed webhook send under `delivery` and `policy`.
pub fn on_send_failure(
    delivery: DeliveryPolicy,
    failure: SendFailure,
    policy: &RetryPolicy,
) -> SendVerdict {
    match (delivery, failure.may_have_arrived) {
        // Never sent twice: whatever the status, it may have been acted on.
        (DeliveryPolicy::AtMostOnce, true) => SendVerdict::Unknown,
        (DeliveryPolicy::AtMostOnce, false) | (DeliveryPolicy::AtLeastOnce, _) => {
            if !failure.retryable {
                SendVerdict::Refused
            } else if policy.exhausted(failure.sends) {
                SendVerdict::BudgetSpent
            } else {
                SendVerdict::Retry
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(done: bool, until_ms: Option<i64>, epoch: Option<i64>) -> SendRow {
        let now = Utc::now();
        SendRow {
            done,
            in_flight_until: until_ms.map(|ms| now + chrono::Duration::milliseconds(ms)),
            in_flight_epoch: epoch,
            now,
        }
    }

    /// The whole matrix: recorded × in-flight mark (none, live, expired) ×
    /// epoch (ours, older) × mode.
    #[test]
    fn decide_send_covers_every_case() {
        use SendDecision::*;
        use SendMode::*;
        let ours = 7;
        for mode in [AtLeastOnce, AtMostOnce] {
            // Recorded: never sent again, whatever the marks say.
            for (until, epoch) in [
                (None, None),
                (Some(5_000), Some(ours)),
                (Some(-5_000), Some(3)),
            ] {
                assert_eq!(decide_send(&row(true, until, epoch), ours, mode), Done);
            }
            // A live mark of our own epoch: a sibling attempt is sending; wait.
            assert!(matches!(
                decide_send(&row(false, Some(5_000), Some(ours)), ours, mode),
                Wait { .. }
            ));
            // Never sent (or its failure recorded): send.
            assert_eq!(decide_send(&row(false, None, None), ours, mode), Send);
        }
        // A send whose outcome was never recorded: a live mark of an older
        // epoch (a takeover) or an expired one of any epoch.
        for (until, epoch) in [
            (Some(5_000), Some(3)),
            (Some(-5_000), Some(ours)),
            (Some(-5_000), Some(3)),
        ] {
            assert_eq!(
                decide_send(&row(false, until, epoch), ours, AtLeastOnce),
                Send
            );
            assert_eq!(
                decide_send(&row(false, until, epoch), ours, AtMostOnce),
                Unknown
            );
        }
    }

    use crate::error::{ErrorEnvelope, StoreError};
    use crate::faults::FailPoint;

    const POLICY: RetryPolicy = RetryPolicy {
        base: Duration::from_millis(10),
        max: Duration::from_secs(1),
        retry_after_cap: Duration::from_secs(5),
        budget: 3,
    };

    fn envelope() -> ErrorEnvelope {
        ErrorEnvelope {
            code: "x".into(),
            message: "x".into(),
            retryable: true,
        }
    }

    #[test]
    fn send_failures_over_the_whole_matrix() {
        use DeliveryPolicy::*;
        use SendVerdict::*;
        for delivery in [AtLeastOnce, AtMostOnce] {
            for may_have_arrived in [false, true] {
                for retryable in [false, true] {
                    for sends in 1..=4 {
                        let f = SendFailure {
                            may_have_arrived,
                            retryable,
                            sends,
                        };
                        let expected = if delivery == AtMostOnce && may_have_arrived {
                            Unknown
                        } else if !retryable {
                            Refused
                        } else if sends >= POLICY.budget {
                            BudgetSpent
                        } else {
                            Retry
                        };
                        assert_eq!(
                            on_send_failure(delivery, f, &POLICY),
                            expected,
                            "{delivery:?} {f:?}"
                        );
                    }
                }
            }
        }
        // Each closing verdict names the row's end and a reason.
        assert_eq!(Retry.closes("http_503", 1), None);
        assert_eq!(
            Unknown.closes("http_503", 1).unwrap().0,
            OutboxStatus::Unknown
        );
        assert_eq!(Refused.closes("http_410", 1).unwrap().0, OutboxStatus::Dead);
        assert!(Refused
            .closes("http_410", 1)
            .unwrap()
            .1
            .contains("http_410"));
        assert!(BudgetSpent
            .closes("http_503", 3)
            .unwrap()
            .1
            .contains("budget"));
    }

    #[test]
    fn step_failures_map_to_one_verdict_each() {
        let state = JobState::Received;
        assert_eq!(
            on_failure(&StepError::LeaseLost, state, &POLICY, 1),
            Verdict::Stop
        );
        assert_eq!(
            on_failure(
                &StepError::Injected(Injected::Crash(FailPoint::Ack)),
                state,
                &POLICY,
                1
            ),
            Verdict::Stop
        );
        assert_eq!(
            on_failure(
                &StepError::Injected(Injected::Fail(FailPoint::Ack)),
                state,
                &POLICY,
                4
            ),
            Verdict::Retry {
                attempt: 1,
                retry_after: None
            }
        );
        for attempt in 1..=4 {
            let e = StepError::Retry {
                error: envelope(),
                attempt,
                retry_after: Some(Duration::from_secs(2)),
            };
            let v = on_failure(&e, state, &POLICY, 9);
            if attempt >= POLICY.budget {
                assert!(matches!(v, Verdict::Dead { ref reason } if reason.contains("budget")));
            } else {
                assert_eq!(
                    v,
                    Verdict::Retry {
                        attempt,
                        retry_after: Some(Duration::from_secs(2))
                    }
                );
            }
        }
        // A transient store error past its in-place budget: retried, backing
        // off with the job's store failures (not its leases); dead only once
        // it persisted over STORE_ATTEMPTS attempts (the statement, not the
        // database, fails).
        for earlier in [0, 1, STORE_ATTEMPTS - 2] {
            let e = StepError::Store(StoreError::Batch(crate::error::BatchError::Gone));
            assert_eq!(
                on_failure(&e, state, &POLICY, earlier),
                Verdict::Retry {
                    attempt: earlier + 1,
                    retry_after: None
                }
            );
        }
        let e = StepError::Store(StoreError::Batch(crate::error::BatchError::Dropped));
        assert!(matches!(
            on_failure(&e, state, &POLICY, STORE_ATTEMPTS - 1),
            Verdict::Dead { ref reason } if reason.contains("kept failing")
        ));
        let invalid = StepError::Store(StoreError::InvalidData("NUL".into()));
        assert_eq!(
            on_failure(&invalid, JobState::Claimed, &POLICY, 1),
            Verdict::Dead {
                reason: "permanent error in state claimed".into()
            }
        );
        let refused = StepError::permanent("model_key_conflict", "key reused", "details");
        assert_eq!(
            on_failure(&refused, state, &POLICY, 1),
            Verdict::Dead {
                reason: "key reused".into()
            }
        );
    }

    /// Every failure an outbound call can end with, against the rule
    /// spelled out row by row: the whole input space of `on_call_failure`.
    #[test]
    fn on_call_failure_covers_every_failure() {
        use CallVerdict::*;
        let after = Some(Duration::from_secs(7));
        let text = || "x".to_owned();
        for (failure, expected) in [
            (Failure::NotSent(text()), Retry { retry_after: None }),
            (Failure::Ambiguous(text()), Retry { retry_after: None }),
            (Failure::BadResponse(text()), Retry { retry_after: None }),
            (Failure::Refused(text()), Permanent),
            (Failure::TooLarge { limit: 10 }, Permanent),
        ] {
            assert_eq!(on_call_failure(&failure), expected, "{failure:?}");
        }
        for status in 100..=599u16 {
            for retry_after in [None, after] {
                let failure = Failure::Status {
                    status,
                    retry_after,
                    body: String::new(),
                };
                let expected = match status {
                    429 | 529 => Throttled { retry_after },
                    408 | 500..=599 => Retry { retry_after },
                    _ => Permanent,
                };
                let verdict = on_call_failure(&failure);
                assert_eq!(verdict, expected, "HTTP {status}");
                assert_eq!(verdict.retries(), expected != Permanent);
                assert_eq!(
                    verdict.call_end() == CallEnd::Throttled,
                    matches!(status, 429 | 529),
                    "HTTP {status}"
                );
                // What is stored agrees with what is decided.
                assert_eq!(
                    failure.envelope().retryable,
                    verdict.retries(),
                    "HTTP {status}"
                );
            }
        }
    }

    #[test]
    fn on_tool_error_covers_every_step_error() {
        use crate::error::{ErrorEnvelope, StoreError};
        use crate::faults::FailPoint;
        let envelope = || ErrorEnvelope {
            code: "x".into(),
            message: "x".into(),
            retryable: true,
        };
        let after = Some(Duration::from_secs(3));
        for (error, expected) in [
            (
                StepError::Retry {
                    error: envelope(),
                    attempt: 2,
                    retry_after: after,
                },
                CallVerdict::Retry { retry_after: after },
            ),
            (
                StepError::Injected(Injected::Fail(FailPoint::ToolAfterEffect)),
                CallVerdict::Retry { retry_after: None },
            ),
            (
                StepError::Store(StoreError::Batch(crate::error::BatchError::Gone)),
                CallVerdict::Retry { retry_after: None },
            ),
            (
                StepError::Store(StoreError::InvalidData("x".into())),
                CallVerdict::Permanent,
            ),
            (
                StepError::Injected(Injected::Crash(FailPoint::ToolAfterEffect)),
                CallVerdict::Permanent,
            ),
            (StepError::LeaseLost, CallVerdict::Permanent),
            (
                StepError::Waiting {
                    kind: "sleep",
                    name: "x".into(),
                    until: chrono::Utc::now(),
                    due: None,
                },
                CallVerdict::Permanent,
            ),
            (StepError::Draining, CallVerdict::Permanent),
            (StepError::permanent("x", "x", "x"), CallVerdict::Permanent),
            (
                StepError::InvalidInput(crate::error::InvalidInput::new("input", "x")),
                CallVerdict::Permanent,
            ),
        ] {
            assert_eq!(on_tool_error(&error), expected, "{error:?}");
        }
    }

    /// The enum's values are the SQL enum's, as the first migration made it.
    #[test]
    fn outbox_statuses_are_the_sql_enums_values() {
        let migration = include_str!("../../../migrations/2026-11-29-000001_lifecycle/up.sql");
        let line = migration
            .lines()
            .find(|l| l.contains("CREATE TYPE outbox_status"))
            .expect("the migration creates outbox_status");
        let all = [
            OutboxStatus::Claimed,
            OutboxStatus::Delivered,
            OutboxStatus::Unknown,
            OutboxStatus::Dead,
        ];
        let quoted: Vec<String> = all.iter().map(|s| format!("'{}'", s.as_sql())).collect();
        assert_eq!(line.matches('\'').count(), 2 * all.len(), "{line}");
        for q in quoted {
            assert!(line.contains(&q), "{q} not in {line}");
        }
    }
}
