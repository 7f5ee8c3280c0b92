//! Resource bounds of intake and of event streams: the backlog a node
//! accepts (per token too) and the streams it serves at once.

use super::*;

/// Per token (`None`: no token): when the backlog was read, in total and its own.
pub(super) type BacklogSeen =
    std::collections::HashMap<Option<i64>, (std::time::Instant, u64, u64)>;

/// Resource bounds of intake.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// A request body must arrive within this long (a client dribbling it,
    /// slowloris-style, gets `408`).
    pub body_timeout: std::time::Duration,
    /// Unfinished jobs in the database above which new jobs are refused
    /// with `429` and `Retry-After`.
    pub max_backlog: u64,
    /// The same bound per API token.
    pub max_backlog_per_token: u64,
    /// The last counts read, with when (refreshed at most once a second).
    seen: Arc<std::sync::Mutex<BacklogSeen>>,
    /// Event streams (`GET /v1/jobs/{id}/events`) open at once on this
    /// node; one more is `429`. Each reads the journal about every 250 ms
    /// until its job ends, on the pool the engine writes through.
    pub max_streams: usize,
    /// The same bound per API token.
    pub max_streams_per_token: usize,
    /// The shortest time between two fire times of a schedule a token
    /// (not admin) creates (`ONCEFLOW_MIN_SCHEDULE_INTERVAL`, default 60 s).
    pub min_schedule_interval: std::time::Duration,
    /// The event streams open now: in all, and per token.
    streams: Arc<std::sync::Mutex<OpenStreams>>,
    /// Bytes of job intake bodies (a submit, a batch) this node holds at
    /// once, from before they are read until they are answered
    /// (`ONCEFLOW_MAX_BODY_BYTES_IN_FLIGHT`); one more is `429 busy`.
    pub max_body_bytes: usize,
    /// The same bound per API token (`ONCEFLOW_MAX_BODY_BYTES_PER_TOKEN`).
    pub max_body_bytes_per_token: usize,
    /// The intake bytes held now: in all, and per token.
    bodies: Arc<std::sync::Mutex<HeldBytes>>,
}

#[derive(Debug, Default)]
pub(super) struct HeldBytes {
    total: usize,
    per_token: std::collections::HashMap<Option<i64>, usize>,
}

/// A request body's place under [`Bounds::max_body_bytes`], given back
/// when the request is answered.
pub(super) struct BodyPlace {
    bodies: Arc<std::sync::Mutex<HeldBytes>>,
    token: Option<i64>,
    bytes: usize,
}

impl Drop for BodyPlace {
    fn drop(&mut self) {
        let mut held = self.bodies.lock().expect("bodies lock");
        held.total -= self.bytes;
        if let Some(n) = held.per_token.get_mut(&self.token) {
            *n -= self.bytes;
            if *n == 0 {
                held.per_token.remove(&self.token);
            }
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct OpenStreams {
    total: usize,
    per_token: std::collections::HashMap<i64, usize>,
}

/// An open event stream's place under [`Bounds::max_streams`], given back
/// when the stream ends.
pub(super) struct StreamSlot {
    streams: Arc<std::sync::Mutex<OpenStreams>>,
    token: Option<i64>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.lock().expect("streams lock");
        open.total -= 1;
        if let Some(token) = self.token {
            if let Some(n) = open.per_token.get_mut(&token) {
                *n -= 1;
                if *n == 0 {
                    open.per_token.remove(&token);
                }
            }
        }
    }
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            body_timeout: std::time::Duration::from_secs(30),
            max_backlog: 100_000,
            max_backlog_per_token: 10_000,
            seen: Default::default(),
            max_streams: 1_000,
            max_streams_per_token: 100,
            min_schedule_interval: std::time::Duration::from_secs(60),
            streams: Default::default(),
            max_body_bytes: 64 << 20,
            max_body_bytes_per_token: 32 << 20,
            bodies: Default::default(),
        }
    }
}

impl Bounds {
    /// These bounds, with the default body timeout.
    pub fn backlog(max_backlog: u64, max_backlog_per_token: u64) -> Self {
        Bounds {
            max_backlog,
            max_backlog_per_token,
            ..Bounds::default()
        }
    }

    /// A place for a request body of up to `bytes` of `token` (`None`:
    /// development mode or an admin's, counted together), or why not.
    pub(super) fn hold_body(&self, token: Option<i64>, bytes: usize) -> Result<BodyPlace, String> {
        let mut held = self.bodies.lock().expect("bodies lock");
        if held.total + bytes > self.max_body_bytes {
            return Err(format!(
                "this node holds {} bytes of request bodies; with {bytes} more it would pass its bound of {}",
                held.total, self.max_body_bytes
            ));
        }
        let mine = held.per_token.entry(token).or_insert(0);
        if *mine + bytes > self.max_body_bytes_per_token {
            let n = *mine;
            if n == 0 {
                held.per_token.remove(&token);
            }
            return Err(format!(
                "this token has {n} bytes of request bodies in flight; with {bytes} more it would pass its bound of {}",
                self.max_body_bytes_per_token
            ));
        }
        *mine += bytes;
        held.total += bytes;
        Ok(BodyPlace {
            bodies: self.bodies.clone(),
            token,
            bytes,
        })
    }

    /// A place for one more event stream of `token`, or why not.
    pub(super) fn open_stream(&self, token: Option<i64>) -> Result<StreamSlot, String> {
        let mut open = self.streams.lock().expect("streams lock");
        if open.total >= self.max_streams {
            return Err(format!(
                "{} event streams are open on this node; the limit is {}",
                open.total, self.max_streams
            ));
        }
        if let Some(token) = token {
            let mine = open.per_token.entry(token).or_insert(0);
            if *mine >= self.max_streams_per_token {
                return Err(format!(
                    "this token has {mine} event streams open; the limit is {}",
                    self.max_streams_per_token
                ));
            }
            *mine += 1;
        }
        open.total += 1;
        Ok(StreamSlot {
            streams: self.streams.clone(),
            token,
        })
    }

    /// Refuses early, before the body is read, a job of `owner` when the
    /// backlog is full, or says there may be room. The counts are read at
    /// most once a second per token (one indexed count, not one per
    /// request). The total's places taken since are added under one lock
    /// (a node's own guard against a burst). The per-token limit is only
    /// looked at here: the word on it is intake's statement's, which holds
    /// it for the whole cluster under a lock per token
    /// ([`Submission::limited`](crate::store::Submission::limited)), so a
    /// request refused later or an identical repeat takes no token's place.
    pub(super) async fn admit(
        &self,
        store: &Store,
        owner: Option<i64>,
    ) -> Result<Result<(), String>, crate::error::StoreError> {
        self.look(store, owner, true).await
    }

    /// Why a job of `owner` would be refused now (as [`admit`](Self::admit)
    /// says), taking no place: the front door's refusal before a body is
    /// read.
    pub(super) async fn backlog_full(
        &self,
        store: &Store,
        owner: Option<i64>,
    ) -> Result<Option<String>, crate::error::StoreError> {
        Ok(self.look(store, owner, false).await?.err())
    }

    async fn look(
        &self,
        store: &Store,
        owner: Option<i64>,
        take: bool,
    ) -> Result<Result<(), String>, crate::error::StoreError> {
        let fresh = |seen: &BacklogSeen| {
            seen.get(&owner)
                .is_some_and(|(at, _, _)| at.elapsed() < std::time::Duration::from_secs(1))
        };
        if !fresh(&self.seen.lock().expect("limits lock")) {
            let (total, mine) = store.retention().backlog(owner).await?;
            let mut seen = self.seen.lock().expect("limits lock");
            // A read that raced this one's may have taken places since.
            if !fresh(&seen) {
                seen.insert(owner, (std::time::Instant::now(), total, mine));
            }
        }
        let mut seen = self.seen.lock().expect("limits lock");
        let (_, total, mine) = seen.get_mut(&owner).expect("read above");
        if *total >= self.max_backlog {
            return Ok(Err(format!(
                "{total} unfinished jobs; the limit is {}",
                self.max_backlog
            )));
        }
        if owner.is_some() && *mine >= self.max_backlog_per_token {
            return Ok(Err(format!(
                "this token has {mine} unfinished jobs; the limit is {}",
                self.max_backlog_per_token
            )));
        }
        if take {
            *total += 1;
        }
        Ok(Ok(()))
    }
}
