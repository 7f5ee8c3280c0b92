//! The limiter: a node's model calls waiting on a provider quota (see
//! [`crate::rules::quota`] for the limits and their arithmetic), queued over every
//! node by priority and woken by `NOTIFY` when a slot frees.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::rules::quota::Limits;

/// A node's view of the limits: the configuration, the keys being learned
/// (refreshed every second), and the wake-up for waiting calls.
#[derive(Debug, Default)]
pub struct Limiter {
    limits: Limits,
    learned: Mutex<(Option<Instant>, HashSet<String>)>,
    /// Per key: this node's calls waiting for admission, best first.
    waiting: Mutex<HashMap<String, Queue>>,
}

/// One key's calls waiting on this node, best first.
#[derive(Debug, Default)]
struct Queue {
    next: u64,
    calls: std::collections::BTreeMap<Place, Arc<tokio::sync::Notify>>,
}

/// A call's place in its key's queue on this node; leaving it (dropped)
/// wakes the next call.
#[derive(Debug)]
pub(crate) struct Waiting {
    limiter: Arc<Limiter>,
    key: String,
    place: Place,
    notify: Arc<tokio::sync::Notify>,
}

/// A call's rank on this node: priority (highest first), then when the
/// shared queue first refused it (microseconds), then arrival; the same
/// order as `provider_waiters`, so the call the database lets go next is
/// the one its node wakes.
type Place = (Reverse<i32>, i64, u64);

impl Waiting {
    /// Ranks the call by the time the shared queue first refused it.
    pub(crate) fn queued_since(&mut self, since_us: i64) {
        if self.place.1 == since_us {
            return;
        }
        let mut waiting = self.limiter.waiting.lock().expect("lock");
        if let Some(q) = waiting.get_mut(&self.key) {
            q.calls.remove(&self.place);
            self.place.1 = since_us;
            q.calls.insert(self.place, self.notify.clone());
        }
    }

    /// Resolves when this call is woken (or was woken while awake).
    pub(crate) async fn woken(&self) {
        self.notify.notified().await;
    }

    /// Whether this call is the best queued on this node for its key: the
    /// one that asks again on a timer, and keeps the node's waiter rows fresh.
    pub(crate) fn is_best(&self) -> bool {
        self.limiter
            .waiting
            .lock()
            .expect("lock")
            .get(&self.key)
            .and_then(|q| q.calls.first_key_value().map(|(p, _)| *p == self.place))
            .unwrap_or(false)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        {
            let mut waiting = self.limiter.waiting.lock().expect("lock");
            if let Some(q) = waiting.get_mut(&self.key) {
                q.calls.remove(&self.place);
                if q.calls.is_empty() {
                    waiting.remove(&self.key);
                }
            }
        }
        // The next call takes over: the asking on a timer if this one was
        // refused to the end, or the room this one may have left (a wake-up
        // meant for the next call can reach this one as it is admitted).
        self.limiter.wake(&self.key);
    }
}

/// How often a node re-reads which keys are being learned.
const LEARNED_REFRESH: Duration = Duration::from_secs(1);

impl Limiter {
    /// A limiter for `limits`.
    pub fn new(limits: Limits) -> Self {
        Limiter {
            limits,
            ..Limiter::default()
        }
    }

    /// The configuration.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether calls of `key` go through admission (`configured`, or
    /// learned on any node within the last second), refreshing the learned
    /// set from `store` when it is older than a second.
    pub(crate) async fn limited(
        &self,
        store: &crate::store::Store,
        key: &str,
        configured: bool,
    ) -> bool {
        if configured {
            return true;
        }
        let stale = {
            // One caller refreshes; the others use the set as it is.
            let mut learned = self.learned.lock().expect("lock");
            let stale = learned.0.is_none_or(|at| at.elapsed() >= LEARNED_REFRESH);
            if stale {
                learned.0 = Some(Instant::now());
            }
            stale
        };
        if stale {
            if let Ok(keys) = store.limits().learned_keys().await {
                self.learned.lock().expect("lock").1 = keys.into_iter().collect();
            }
        }
        self.learned.lock().expect("lock").1.contains(key)
    }

    /// Queues a call of `key` with `priority` on this node: until it is
    /// admitted or dropped, [`wake`](Self::wake) reaches the best queued
    /// call (highest priority, then the oldest) rather than all of them.
    pub(crate) fn enqueue(self: &Arc<Self>, key: &str, priority: i32) -> Waiting {
        let mut waiting = self.waiting.lock().expect("lock");
        let queue = waiting.entry(key.to_owned()).or_default();
        queue.next += 1;
        // Until its first refusal gives it a place in the shared queue, a
        // call ranks after the node's queued calls of its priority.
        let place = (Reverse(priority), i64::MAX, queue.next);
        let notify = Arc::new(tokio::sync::Notify::new());
        queue.calls.insert(place, notify.clone());
        Waiting {
            limiter: self.clone(),
            key: key.to_owned(),
            place,
            notify,
        }
    }

    /// Wakes the best call of `key` queued on this node (a slot was
    /// released, or an admission left room, on some node). Only it asks the
    /// database; if it is admitted with room left, the next is woken in turn.
    pub(crate) fn wake(&self, key: &str) {
        let best = self
            .waiting
            .lock()
            .expect("lock")
            .get(key)
            .and_then(|q| q.calls.first_key_value().map(|(_, n)| n.clone()));
        if let Some(n) = best {
            // A permit is kept when the call is not sleeping yet.
            n.notify_one();
        }
    }

    /// Wakes every waiting call on this node (it drains: they give up).
    pub(crate) fn wake_all(&self) {
        for q in self.waiting.lock().expect("lock").values() {
            for n in q.calls.values() {
                n.notify_one();
            }
        }
    }

    /// Marks `key` as learned on this node at once (it just saw a 429).
    pub(crate) fn learn(&self, key: &str) {
        self.learned.lock().expect("lock").1.insert(key.to_owned());
    }
}
