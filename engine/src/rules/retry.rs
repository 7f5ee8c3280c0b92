//! Retry policy as data: exponential backoff with full jitter, a floor for
//! rate limits, `Retry-After` honoured but clamped, and a budget that ends in
//! the dead-letter state.

use std::time::Duration;

use rand::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// When and how often a failed send (model call or webhook) is retried before the job is dead.
pub struct RetryPolicy {
    /// The first backoff's upper bound.
    pub base: Duration,
    /// No computed backoff exceeds this.
    pub max: Duration,
    /// A server's `Retry-After` is honoured up to this long.
    pub retry_after_cap: Duration,
    /// Sends allowed in all; the job is dead after the last one fails.
    pub budget: u32,
}

impl RetryPolicy {
    /// Model calls: 500 ms base, 60 s max, `Retry-After` up to 10 min, 8 sends.
    pub const DEFAULT_MODEL: RetryPolicy = RetryPolicy {
        base: Duration::from_millis(500),
        max: Duration::from_secs(60),
        retry_after_cap: Duration::from_secs(600),
        budget: 8,
    };
    /// Webhooks: 1 s base, 5 min max, `Retry-After` up to 1 h, 12 sends.
    pub const DEFAULT_WEBHOOK: RetryPolicy = RetryPolicy {
        base: Duration::from_secs(1),
        max: Duration::from_secs(300),
        retry_after_cap: Duration::from_secs(3600),
        budget: 12,
    };

    /// True when `attempt` sends have been spent.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.budget
    }

    /// How long to wait after the `attempt`-th failed send (1-based): a uniform
    /// draw below `base·2^(attempt-1)` (full jitter), capped at `max`; at
    /// least the server's `Retry-After` when it sent one (clamped to `retry_after_cap`).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.max);
        let jittered = Duration::from_secs_f64(rand::rng().random::<f64>() * exp.as_secs_f64());
        match retry_after {
            Some(ra) => jittered.max(ra.min(self.retry_after_cap)),
            None => jittered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_grows() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
            retry_after_cap: Duration::from_secs(5),
            budget: 5,
        };
        for attempt in 1..40 {
            let cap = Duration::from_millis(100 * (1u64 << (attempt - 1).min(20))).min(p.max);
            for _ in 0..50 {
                assert!(p.delay(attempt, None) <= cap);
            }
        }
        assert!(!p.exhausted(4));
        assert!(p.exhausted(5));
    }

    #[test]
    fn retry_after_is_a_floor_clamped_to_its_cap() {
        let p = RetryPolicy {
            base: Duration::from_millis(1),
            max: Duration::from_secs(1),
            retry_after_cap: Duration::from_secs(10),
            budget: 5,
        };
        assert!(p.delay(1, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(3600))),
            Duration::from_secs(10)
        );
    }
}
