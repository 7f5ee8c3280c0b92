//! What a failure means for a job, decided with no I/O.
//!
//! [`on_failure`] maps a failed step (its [`StepError`], the job's state,
//! its retry policy and attempt) to a [`Verdict`]; [`on_send_failure`]
//! decides what a failed webhook send does under the workflow's delivery
//! policy. The job actor carries the verdict out (`reschedule`, `kill`,
//! `fail_delivery`); these functions are unit-tested over their whole
//! matrix in microseconds, and the crash-point explorer covers the effects.

use std::time::Duration;

use crate::error::StepError;
use crate::faults::Injected;
use crate::lifecycle::JobState;
use crate::retry::RetryPolicy;

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
        StepError::LeaseLost | StepError::Draining | StepError::Injected(Injected::Crash(_)) => {
            Verdict::Stop
        }
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
    pub fn closes(self, error_code: &str, sends: u32) -> Option<(&'static str, String)> {
        match self {
            SendVerdict::Retry => None,
            SendVerdict::Unknown => Some((
                "unknown",
                "delivery outcome unknown (at-most-once): the send failed after it left".into(),
            )),
            SendVerdict::Refused => Some((
                "dead",
                format!("the webhook consumer refused the delivery permanently ({error_code})"),
            )),
            SendVerdict::BudgetSpent => Some((
                "dead",
                format!("retry budget exhausted after {sends} sends"),
            )),
        }
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
        assert_eq!(Unknown.closes("http_503", 1).unwrap().0, "unknown");
        assert_eq!(Refused.closes("http_410", 1).unwrap().0, "dead");
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
            let e = StepError::Store(StoreError::Batch("database gone".into()));
            assert_eq!(
                on_failure(&e, state, &POLICY, earlier),
                Verdict::Retry {
                    attempt: earlier + 1,
                    retry_after: None
                }
            );
        }
        let e = StepError::Store(StoreError::Batch("refused again".into()));
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
}
