//! This node's fan-out in memory: who follows a streamed job here, and who
//! must hear at once that a token was revoked or given a new secret.
//!
//! Nothing here is durable, and nothing here is SQL: the store commits a
//! stream's chunks and returns them ([`Published`]), and the context hands
//! them to the hub; other nodes' commits and token changes arrive as
//! `NOTIFY`s, which the runtime hands to the hub. The API's open streams
//! and the node's cache of signing secrets subscribe. One hub per node,
//! shared by its engine and its API.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::store::streams::Published;

/// This node's watchers of streamed jobs, and the token changes it hears.
#[derive(Debug)]
pub struct Hub {
    jobs: Mutex<HashMap<String, broadcast::Sender<Arc<Published>>>>,
    /// Ids of tokens revoked or given a new secret.
    tokens: broadcast::Sender<i64>,
}

impl Default for Hub {
    fn default() -> Self {
        Hub {
            jobs: Mutex::default(),
            tokens: broadcast::channel(64).0,
        }
    }
}

impl Hub {
    /// Follows `job_id`'s stream on this node: every batch of its chunks
    /// committed here, with its rows, and an empty [`Published`] when
    /// another node announces one. Subscribe before reading the journal.
    pub fn watch(&self, job_id: &str) -> broadcast::Receiver<Arc<Published>> {
        let mut jobs = self.jobs.lock().expect("lock");
        jobs.retain(|_, tx| tx.receiver_count() > 0);
        jobs.entry(job_id.to_owned())
            .or_insert_with(|| broadcast::channel(256).0)
            .subscribe()
    }

    /// Hands `published` (a job's events, as committed) to the job's
    /// watchers here, if it has any.
    pub fn publish(&self, job_id: &str, published: Published) {
        if published.events.is_empty() && published.upto.is_none() {
            return;
        }
        if let Some(tx) = self.jobs.lock().expect("lock").get(job_id) {
            let _ = tx.send(Arc::new(published));
        }
    }

    /// A node announced on [`STREAM_CHANNEL`](crate::store::streams::STREAM_CHANNEL)
    /// that a job's events reach an id (payload `"{job_id} {id}"`): its
    /// watchers here read the journal unless they have seen that far (this
    /// node's own writes reach them first, with their rows).
    pub fn moved(&self, payload: &str) {
        let (job_id, upto) = match payload.rsplit_once(' ') {
            Some((job, id)) => (job, id.parse().ok()),
            None => (payload, None),
        };
        if let Some(tx) = self.jobs.lock().expect("lock").get(job_id) {
            let _ = tx.send(Arc::new(Published {
                prev: None,
                upto,
                events: Vec::new(),
            }));
        }
    }

    /// Ids of tokens revoked or given a new secret, as announced on
    /// [`TOKENS_CHANNEL`](crate::store::streams::TOKENS_CHANNEL).
    pub fn token_changes(&self) -> broadcast::Receiver<i64> {
        self.tokens.subscribe()
    }

    /// Called with each `TOKENS_CHANNEL` notification's payload.
    pub fn token_changed(&self, payload: &str) {
        if let Ok(id) = payload.parse() {
            let _ = self.tokens.send(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announcement_reaches_the_jobs_watchers_only() {
        let hub = Hub::default();
        let mut a = hub.watch("a");
        let mut b = hub.watch("b");
        hub.moved("a 42");
        let got = a.try_recv().expect("a's watcher hears it");
        assert_eq!((got.prev, got.upto), (None, Some(42)));
        assert!(got.events.is_empty());
        assert!(b.try_recv().is_err(), "b's watcher hears nothing");
        hub.publish(
            "b",
            Published {
                prev: Some(1),
                upto: None,
                events: Vec::new(),
            },
        );
        assert!(b.try_recv().is_err(), "nothing to hand on");
        let mut changes = hub.token_changes();
        hub.token_changed("7");
        hub.token_changed("not a number");
        assert_eq!(changes.try_recv().unwrap(), 7);
        assert!(changes.try_recv().is_err());
    }
}
