//! Provider quotas, the pure part: the configuration (`ONCEFLOW_LIMITS`),
//! the token-bucket and learned-window arithmetic, with no I/O. The store
//! keeps the rows ([`crate::store::slots`]); the [`crate::limiter`] makes
//! calls wait their turn.
//!
//! Provider limits are shared by every node on one database.
//!
//! A *limit key* is `provider/model` (`openai/gpt-4o`). `ONCEFLOW_LIMITS`
//! configures per key (by `provider/model`, by model, or `"*"` for each
//! unlisted model on its own) a maximum of concurrent calls, and requests
//! and tokens per minute, enforced as token buckets ([`Bucket`]) on the
//! key's row. Calls waiting for a key queue over every node by priority,
//! then by the time they were first refused. Independently,
//! every key that sees a 429 gets a *learned window* of concurrent calls,
//! shared through PostgreSQL: it starts at 1 (a slow start), grows by
//! 1/(4·window) per answered call (a quarter of a call more per round of
//! answers), and halves on a 429 at most once per 100 ms, so the 429s of
//! one overload count once (additive increase, multiplicative decrease, as
//! TCP does). A call may start when fewer than
//! `min(configured, learned)` calls of its key hold a slot, on any node; a
//! key with neither costs nothing.
//!
//! A slot is a row held by the model call (its key and the attempt's epoch)
//! for the call's timeout (plus 5 s); it is released when the call ends —
//! also when the attempt is dropped mid-call (a guard releases it) — a
//! draining node releases its own, and a crashed node's lapse at their
//! expiry. A waiting call holds no connection. Each node holds its waiting
//! calls in the shared queue's order (`Limiter::enqueue`) and wakes only
//! the best when a release or an admission that leaves room is announced
//! (`NOTIFY onceflow_limits`, the key as payload); that call also asks
//! again every second, the others wait their turn. A window
//! grows only while the calls in flight fill it, and a key whose window has
//! not halved for five minutes is forgotten (no admission until its next 429).

use std::collections::HashMap;

use serde::Deserialize;

/// The limits of one key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// Most calls in flight at once, over every node.
    pub concurrency: Option<u32>,
    /// Requests started per minute, over every node.
    pub rpm: Option<u32>,
    /// Tokens per minute (prompt estimate plus `max_tokens` at the start,
    /// corrected by the usage the answer reports), over every node.
    pub tpm: Option<u32>,
}

/// `ONCEFLOW_LIMITS`, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    by_key: HashMap<String, LimitSpec>,
    default: Option<LimitSpec>,
}

impl Limits {
    /// Parses `{"<model>" | "<provider>/<model>" | "*": {"concurrency": N, "rpm": N, "tpm": N}}`.
    pub fn parse(json: &str) -> Result<Limits, String> {
        let mut by_key: HashMap<String, LimitSpec> = serde_json::from_str(json)
            .map_err(|e| format!("ONCEFLOW_LIMITS is not a JSON object of limits: {e}"))?;
        for (key, spec) in &by_key {
            for (field, value) in [
                ("concurrency", spec.concurrency),
                ("rpm", spec.rpm),
                ("tpm", spec.tpm),
            ] {
                if value == Some(0) {
                    return Err(format!(
                        "ONCEFLOW_LIMITS[{key:?}].{field} must be at least 1"
                    ));
                }
            }
        }
        let default = by_key.remove("*");
        Ok(Limits { by_key, default })
    }

    /// The limits of `provider`'s `model`: its `provider/model` entry, else
    /// its model's, else `"*"` (each entry whole: they do not merge).
    pub fn spec(&self, provider: &str, model: &str) -> LimitSpec {
        self.by_key
            .get(&format!("{provider}/{model}"))
            .or_else(|| self.by_key.get(model))
            .or(self.default.as_ref())
            .copied()
            .unwrap_or_default()
    }

    /// The configured concurrency of `provider`'s `model`.
    pub fn concurrency(&self, provider: &str, model: &str) -> Option<u32> {
        self.spec(provider, model).concurrency
    }

    /// The metric labels of `provider`'s `model`, from a bounded set: a
    /// caller chooses the model name, and every distinct label is a series
    /// kept for the life of the node. The provider is `openai`,
    /// `anthropic` or `other`; the model is its own name when
    /// `ONCEFLOW_LIMITS` names it (alone or as `provider/model`; `*` names
    /// none) and it is at most [`MAX_LABEL`] bytes, else `other`.
    pub fn labels<'a>(&self, provider: &str, model: &'a str) -> (&'static str, &'a str) {
        let provider_label = match provider {
            "openai" => "openai",
            "anthropic" => "anthropic",
            _ => "other",
        };
        let named = model.len() <= MAX_LABEL
            && (self.by_key.contains_key(model)
                || self.by_key.contains_key(&format!("{provider}/{model}")));
        (provider_label, if named { model } else { "other" })
    }
}

/// The longest model name used as a metric label.
pub const MAX_LABEL: usize = 100;

impl LimitSpec {
    /// Whether anything is configured.
    pub fn is_set(&self) -> bool {
        self.concurrency.is_some() || self.rpm.is_some() || self.tpm.is_some()
    }
}

/// A rate limit (`rpm` or `tpm`) as a token bucket shared through the
/// database: it refills at `per_minute / 60` per second and holds at most
/// one second's worth ([`Bucket::capacity`], at least 1), so calls are
/// spread over the minute instead of spent in a burst at its start, as
/// providers that quantize their limits per second expect. A call is
/// admitted when the bucket holds its cost, or is full (a call dearer than
/// a second's worth still runs, alone); its cost is then taken, and the
/// bucket may go into debt, which later calls wait out. Over any `T`
/// seconds at most `capacity + largest cost + per_minute·T/60` is admitted,
/// and the long-run rate is `per_minute`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// The configured rate per minute.
    pub per_minute: f64,
}

impl Bucket {
    /// The most the bucket holds: one second's worth, at least 1.
    pub fn capacity(&self) -> f64 {
        (self.per_minute / 60.0).max(1.0)
    }

    /// Refill per second.
    pub fn per_second(&self) -> f64 {
        self.per_minute / 60.0
    }

    /// The level now: `stored` as of `elapsed` seconds ago, refilled (a
    /// bucket never used is full).
    pub fn level(&self, stored: Option<f64>, elapsed: Option<f64>) -> f64 {
        match (stored, elapsed) {
            (Some(level), Some(secs)) => {
                (level + secs.max(0.0) * self.per_second()).min(self.capacity())
            }
            _ => self.capacity(),
        }
    }

    /// What a call costing `cost` needs in the bucket to be admitted.
    pub fn need(&self, cost: f64) -> f64 {
        cost.min(self.capacity())
    }

    /// Seconds until the bucket at `level` holds `need`, refilling.
    pub fn wait_secs(&self, level: f64, need: f64) -> f64 {
        ((need - level) / self.per_second()).max(0.0)
    }
}

/// What a request is expected to cost against `tpm`, before it is sent: its
/// size in bytes / 4 (about a token per four bytes of JSON) plus the output
/// it allows (`max_tokens` or `max_completion_tokens`; 0 when unbounded).
/// The answer's usage corrects the estimate ([`Limits::end_call`](crate::store::Limits::end_call)).
pub fn estimate_tokens(request: &serde_json::Value) -> f64 {
    let bytes = serde_json::to_vec(request).map_or(0, |b| b.len());
    let output = ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|k| request.get(*k).and_then(serde_json::Value::as_u64))
        .unwrap_or(0);
    (bytes / 4) as f64 + output as f64
}

/// A key's learned window, as stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowState {
    /// Concurrent calls allowed; `None` until the first 429.
    pub window: Option<f64>,
    /// Seconds since the window last halved (`None`: never).
    pub since_decrease: Option<f64>,
    /// Whether the calls in flight (this one included) filled the window.
    pub saturated: bool,
}

/// The window after a call ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextWindow {
    /// The new window.
    pub window: Option<f64>,
    /// Whether this was a decrease (its time is recorded).
    pub decreased: bool,
}

/// The window's growth per answered call, divided by the window.
pub const INCREASE: f64 = 0.25;

/// The shortest time between two halvings of a window, in seconds.
pub const DECREASE_GUARD_SECS: f64 = 0.1;

/// A window that has not halved for this long (seconds) is forgotten.
pub const FORGET_SECS: f64 = 300.0;

/// The controller: additive increase ([`INCREASE`]/window per answered
/// call while the calls in flight fill the window, never past the
/// configured cap), multiplicative decrease (halve on
/// a 429, not below 1, at most once per [`DECREASE_GUARD_SECS`]: the 429s
/// of one overload count once). A key starts learning at its first 429, at
/// a window of 1.
pub fn next_window(state: WindowState, end: CallEnd, cap: Option<u32>) -> NextWindow {
    let cap = cap.map_or(f64::INFINITY, f64::from);
    match (end, state.window) {
        (CallEnd::Throttled, None) => NextWindow {
            window: Some(1.0),
            decreased: true,
        },
        (CallEnd::Throttled, Some(w))
            if state
                .since_decrease
                .is_none_or(|s| s >= DECREASE_GUARD_SECS) =>
        {
            NextWindow {
                window: Some((w / 2.0).max(1.0)),
                decreased: true,
            }
        }
        (CallEnd::Answered, Some(_)) if state.since_decrease.is_some_and(|s| s >= FORGET_SECS) => {
            NextWindow {
                window: None,
                decreased: false,
            }
        }
        (CallEnd::Answered, Some(w)) if state.saturated => NextWindow {
            window: Some((w + INCREASE / w).min(cap.max(1.0))),
            decreased: false,
        },
        (_, window) => NextWindow {
            window,
            decreased: false,
        },
    }
}

/// How a call that held a slot ended, for the learned window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallEnd {
    /// Answered: the window may grow ([`next_window`]).
    Answered,
    /// 429 (or Anthropic's 529): the window halves, at most once per guard interval.
    Throttled,
    /// Anything else: the window stays.
    Other,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_labels_come_from_a_bounded_set() {
        let limits = Limits::parse(
            r#"{"gpt-4o": {"concurrency": 2}, "anthropic/claude": {"rpm": 5}, "*": {"concurrency": 9}}"#,
        )
        .unwrap();
        assert_eq!(limits.labels("openai", "gpt-4o"), ("openai", "gpt-4o"));
        assert_eq!(
            limits.labels("anthropic", "claude"),
            ("anthropic", "claude")
        );
        assert_eq!(limits.labels("openai", "claude"), ("openai", "other"));
        assert_eq!(
            limits.labels("openai", "mine"),
            ("openai", "other"),
            "* names none"
        );
        assert_eq!(limits.labels("evil", "gpt-4o"), ("other", "gpt-4o"));
        let long = "m".repeat(MAX_LABEL + 1);
        let limits = Limits::parse(&format!(r#"{{"{long}": {{"concurrency": 1}}}}"#)).unwrap();
        assert_eq!(limits.labels("openai", &long).1, "other");
    }

    fn step(w: Option<f64>, since: Option<f64>, end: CallEnd, cap: Option<u32>) -> NextWindow {
        next_window(
            WindowState {
                window: w,
                since_decrease: since,
                saturated: true,
            },
            end,
            cap,
        )
    }

    #[test]
    fn limits_resolve_provider_model_then_model_then_star() {
        let l = Limits::parse(
            r#"{"gpt-4o": {"concurrency": 8, "rpm": 500}, "anthropic/gpt-4o": {"concurrency": 2}, "*": {"concurrency": 3}}"#,
        )
        .unwrap();
        assert_eq!(l.concurrency("openai", "gpt-4o"), Some(8));
        assert_eq!(l.concurrency("anthropic", "gpt-4o"), Some(2));
        assert_eq!(l.concurrency("openai", "other"), Some(3));
        assert!(Limits::parse(r#"{"m": {"concurrency": 0}}"#).is_err());
        assert!(Limits::parse(r#"{"m": {"concurency": 1}}"#).is_err());
        assert!(Limits::parse("[]").is_err());
        assert_eq!(Limits::default().concurrency("openai", "m"), None);
    }

    /// The controller on virtual time: a provider that accepts 4 calls at
    /// once, a round of calls per tick, a 429 for every call past 4.
    #[test]
    fn the_window_learns_a_providers_limit_and_stays_near_it() {
        assert_eq!(
            step(None, None, CallEnd::Throttled, None),
            NextWindow {
                window: Some(1.0),
                decreased: true
            },
            "the first 429 starts learning at 1"
        );
        assert_eq!(step(None, None, CallEnd::Answered, None).window, None);
        assert_eq!(
            step(Some(8.0), Some(0.05), CallEnd::Throttled, None).window,
            Some(8.0),
            "one halving per guard interval"
        );
        assert_eq!(
            step(Some(8.0), Some(0.2), CallEnd::Throttled, None).window,
            Some(4.0)
        );
        assert_eq!(
            step(Some(1.5), Some(2.0), CallEnd::Throttled, None).window,
            Some(1.0)
        );
        assert_eq!(
            step(Some(4.0), None, CallEnd::Answered, Some(4)).window,
            Some(4.0)
        );

        let limit = 4usize;
        let mut state = WindowState {
            window: Some(1.0),
            since_decrease: Some(0.0),
            saturated: true,
        };
        let (mut sent, mut throttled, mut late_sent, mut late_throttled) = (0, 0, 0, 0);
        let tick = 0.2; // seconds per round of calls
        for round in 0..200 {
            let now_calls = state.window.unwrap().floor() as usize;
            for call in 0..now_calls {
                let end = if call < limit {
                    CallEnd::Answered
                } else {
                    CallEnd::Throttled
                };
                sent += 1;
                if round as f64 * tick >= 2.0 {
                    late_sent += 1;
                }
                if end == CallEnd::Throttled {
                    throttled += 1;
                    if round as f64 * tick >= 2.0 {
                        late_throttled += 1;
                    }
                }
                let next = next_window(state, end, None);
                state = WindowState {
                    window: next.window,
                    since_decrease: if next.decreased {
                        Some(0.0)
                    } else {
                        state.since_decrease
                    },
                    // The calls of a round fill the window when it is at or
                    // under the provider's limit and the demand is there.
                    saturated: true,
                };
            }
            state.since_decrease = state.since_decrease.map(|s| s + tick);
        }
        let w = state.window.unwrap();
        assert!(
            (1.0..=6.0).contains(&w),
            "the window stays near the limit: {w}"
        );
        assert!(throttled > 0, "it probed past the limit");
        let share = late_throttled as f64 / late_sent as f64;
        assert!(
            share < 0.05,
            "{late_throttled} of {late_sent} late calls throttled ({sent} sent)"
        );
    }
}
