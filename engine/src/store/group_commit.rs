//! Group commit for checkpoints: the same write from many actors becomes one
//! statement and one commit.
//!
//! A [`Batcher`] is a task on the database runtime. An actor hands it one
//! request and waits; the task takes every request waiting at that moment
//! (up to a limit), runs them as one statement over arrays, and answers each
//! actor with its own row's outcome — only after the commit, so no
//! checkpoint is acknowledged before it is durable. With one actor there is
//! no waiting and no delay: a batch of one is the plain statement. The
//! requests that arrive while a batch runs form the next. Two batches of a
//! kind may run at once, but a small one (under [`SMALL_BATCH`]) waits for
//! the running one to end and takes in what arrives meanwhile, until it
//! holds that many: each statement costs PostgreSQL a fixed ~0.33 ms (the
//! `delivered` batch, measured), a large share of its CPU at moderate load;
//! docs/benchmarks.md has the method and the figures. A request so waits for at most
//! two batches ahead of it: one for a slot when both are busy, then, if its
//! batch is small, the one still running beside — a batch's time, the
//! price of the fewer statements at the maximum.
//!
//! When a batch fails, its requests are written again one by one, so one
//! row PostgreSQL refuses fails only its own request, never its batchmates.
//! A batched read ([`Batcher::start_read`]) has no row to refuse: its
//! failed batch fails each request with the batch's error, and each
//! caller's retry decides.
//!
//! A job appears at most once per batch (a second request for it, from a
//! concurrent attempt sharing the lease, waits for the next batch), and a
//! batch locks its job rows in id order, as the heartbeat does, so batches
//! and heartbeats cannot deadlock.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::AsyncPgConnection;
use tokio::sync::{mpsc, oneshot};

use crate::error::{BatchError, StoreError};

/// Most requests in one statement.
pub(crate) const MAX_BATCH: usize = 256;
/// Batches of one kind in flight at once: while one commits, the next forms
/// and runs (a small one waits for the running one: see [`SMALL_BATCH`]).
const CONCURRENT_BATCHES: usize = 2;
/// A batch smaller than this waits for the one in flight before it runs; a
/// queue this long runs beside it at once.
pub(crate) const SMALL_BATCH: usize = 8;

type Reply<O> = oneshot::Sender<Result<O, StoreError>>;

/// Runs one batch: gets the requests (distinct jobs), returns one outcome per
/// request, in order. The requests are shared, not copied: when the batch
/// fails they are taken back to be written one by one.
pub(crate) type RunBatch<R, O> = Box<
    dyn Fn(
            Pool<AsyncPgConnection>,
            Arc<Vec<R>>,
        ) -> Pin<Box<dyn Future<Output = Result<Vec<O>, StoreError>> + Send>>
        + Send
        + Sync,
>;

/// A request that names the job it writes: a batch holds a job at most once.
pub(crate) trait Keyed {
    fn job_id(&self) -> &str;
}

/// A request that writes under a job's lease.
pub(crate) trait ForJob {
    fn fence(&self) -> &crate::store::Fence;
}

impl<T: ForJob> Keyed for T {
    fn job_id(&self) -> &str {
        &self.fence().job_id
    }
}

/// Hands requests of one kind to the batching task.
pub(crate) struct Batcher<R, O> {
    tx: mpsc::UnboundedSender<(R, Reply<O>)>,
    /// While true, requests queue and no batch starts (a test seam: releasing
    /// it runs everything queued as one batch).
    hold: tokio::sync::watch::Sender<bool>,
    /// The most requests one batch has held.
    largest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Requests handed in and not yet taken into a batch.
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<R, O> std::fmt::Debug for Batcher<R, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

/// A batcher's test seam: hold its batches, count what waits, see the
/// largest batch it ran.
#[derive(Clone, Copy)]
pub struct BatchSeam<'a> {
    hold: &'a tokio::sync::watch::Sender<bool>,
    largest: &'a std::sync::atomic::AtomicUsize,
    queued: &'a std::sync::atomic::AtomicUsize,
}

impl BatchSeam<'_> {
    /// Holds (true) or releases (false) the batches: while held, requests
    /// queue and no batch starts; releasing runs everything queued (up to
    /// the batch limit) as one batch.
    pub fn hold(self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// Requests handed in and not yet taken into a batch.
    pub fn queued(self) -> usize {
        self.queued.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most requests one batch has held.
    pub fn largest(self) -> usize {
        self.largest.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl<R, O> Batcher<R, O>
where
    R: Keyed + Clone + Send + Sync + 'static,
    O: Send + 'static,
{
    /// Starts the task on the database runtime; it ends when the last
    /// handle is dropped.
    pub(crate) fn start(db: &crate::db::Db, run: RunBatch<R, O>) -> Self {
        Self::start_with(db, run, true)
    }

    /// [`start`](Self::start) for a read: a failed batch fails each of its
    /// requests with the batch's error (a read has no row to refuse, so
    /// running them one by one would only wait out the outage once each),
    /// and each caller's own retry decides.
    pub(crate) fn start_read(db: &crate::db::Db, run: RunBatch<R, O>) -> Self {
        Self::start_with(db, run, false)
    }

    fn start_with(db: &crate::db::Db, run: RunBatch<R, O>, split: bool) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<(R, Reply<O>)>();
        let pool = db.pool();
        let run = std::sync::Arc::new(run);
        let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(CONCURRENT_BATCHES));
        let (hold, mut held) = tokio::sync::watch::channel(false);
        let largest = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let largest_seen = largest.clone();
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let taken = queued.clone();
        db.spawn(async move {
            let mut carried: Vec<(R, Reply<O>)> = Vec::new();
            loop {
                // A free slot first, so the batch takes everything queued by then.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                if carried.is_empty() {
                    match rx.recv().await {
                        Some(first) => carried.push(first),
                        None => return,
                    }
                }
                while *held.borrow_and_update() {
                    if held.changed().await.is_err() {
                        break;
                    }
                }
                while carried.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(next) => carried.push(next),
                        Err(_) => break,
                    }
                }
                // A small batch while the other slot's batch runs waits for
                // it and grows meanwhile (see `grow_while_busy`).
                if carried.len() < SMALL_BATCH && slots.available_permits() == 0 {
                    grow_while_busy(&mut carried, &mut rx, &slots).await;
                }
                // One request per job in this batch; repeats wait for the next.
                let mut seen = HashSet::new();
                let (batch, rest): (Vec<_>, Vec<_>) = carried
                    .drain(..)
                    .partition(|(r, _)| seen.insert(r.job_id().to_owned()));
                carried = rest;
                let (requests, replies): (Vec<R>, Vec<Reply<O>>) = batch.into_iter().unzip();
                let n = requests.len();
                largest_seen.fetch_max(n, std::sync::atomic::Ordering::Relaxed);
                taken.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
                let (run, pool) = (run.clone(), pool.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    run_batch(&run, pool, requests, replies, split).await;
                });
            }
        });
        Batcher {
            tx,
            hold,
            largest,
            queued,
        }
    }

    /// This batcher's test seam.
    pub(crate) fn seam(&self) -> BatchSeam<'_> {
        BatchSeam {
            hold: &self.hold,
            largest: &self.largest,
            queued: &self.queued,
        }
    }

    /// [`Self::call`], submitted again while `store`'s retry budget for
    /// `what` allows (a transient failure of the batch: a lost connection,
    /// a serialization failure); the outcome of the last try.
    pub(crate) async fn call_retrying(
        &self,
        store: &super::Store,
        what: &'static str,
        request: R,
    ) -> Result<O, StoreError>
    where
        R: Clone,
    {
        let mut retry = store.retry(what);
        loop {
            match self.call(request.clone()).await {
                Err(e) if retry.again(&e) => retry.wait().await,
                other => return other,
            }
        }
    }

    /// Submits `request` and waits for its outcome (after the commit).
    pub(crate) async fn call(&self, request: R) -> Result<O, StoreError> {
        let (reply, outcome) = oneshot::channel();
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.tx
            .send((request, reply))
            .map_err(|_| BatchError::Gone)?;
        outcome.await.map_err(|_| BatchError::Dropped)?
    }
}

/// Grows a small batch while the other slot's batch runs: each statement
/// costs PostgreSQL a fixed ~0.33 ms (the `delivered` batch, measured), a
/// large share of its CPU at moderate load. It stops waiting once it holds
/// [`SMALL_BATCH`] requests, so a slow batch never stalls a long queue of
/// its kind.
async fn grow_while_busy<T>(
    carried: &mut Vec<T>,
    rx: &mut mpsc::UnboundedReceiver<T>,
    slots: &tokio::sync::Semaphore,
) {
    let running = slots.acquire();
    tokio::pin!(running);
    loop {
        tokio::select! {
            ended = &mut running => {
                drop(ended);
                break;
            }
            next = rx.recv() => match next {
                Some(next) => {
                    carried.push(next);
                    if carried.len() >= SMALL_BATCH {
                        break;
                    }
                }
                None => break,
            },
        }
    }
    while carried.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(next) => carried.push(next),
            Err(_) => break,
        }
    }
}

/// Runs one batch and answers each of its requests. With `split`, a failed
/// batch is written again one request at a time, so one bad row fails only
/// its own request; without, each request gets the batch's error.
async fn run_batch<R: Clone, O>(
    run: &RunBatch<R, O>,
    pool: Pool<AsyncPgConnection>,
    requests: Vec<R>,
    replies: Vec<Reply<O>>,
    split: bool,
) {
    let n = requests.len();
    let requests = Arc::new(requests);
    let outcomes = match run(pool.clone(), requests.clone()).await {
        Ok(outcomes) if outcomes.len() == n => outcomes.into_iter().map(Ok).collect(),
        Ok(outcomes) => {
            let got = outcomes.len();
            (0..n)
                .map(|_| Err(BatchError::Miscounted { sent: n, got }.into()))
                .collect()
        }
        Err(e) if n > 1 && split => {
            tracing::warn!(error = %e, batch = n, "a batched write failed; writing its rows one by one");
            // The failed run has dropped its share by now.
            let requests = Arc::try_unwrap(requests).unwrap_or_else(|shared| (*shared).clone());
            let mut each = Vec::with_capacity(n);
            for request in requests {
                each.push(match run(pool.clone(), Arc::new(vec![request])).await {
                    Ok(mut one) if one.len() == 1 => Ok(one.remove(0)),
                    Ok(one) => Err(BatchError::Miscounted {
                        sent: 1,
                        got: one.len(),
                    }
                    .into()),
                    Err(e) => Err(e),
                });
            }
            each
        }
        Err(e) if n > 1 => {
            let (message, retryable) = (e.to_string(), e.is_retryable());
            (0..n)
                .map(|_| {
                    Err(BatchError::Failed {
                        message: message.clone(),
                        retryable,
                    }
                    .into())
                })
                .collect()
        }
        Err(e) => vec![Err(e)],
    };
    for (reply, outcome) in replies.into_iter().zip(outcomes) {
        let _ = reply.send(outcome);
    }
}
