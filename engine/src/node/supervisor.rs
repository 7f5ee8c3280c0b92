//! The supervisor: one actix actor per node. It leases runnable work and
//! starts a [`JobActor`] per job, renews the leases of everything in flight in
//! one batched statement, and resumes stalled jobs.
//!
//! Resuming is the same query as taking new work: a job whose lease expired
//! (its actor crashed, its process died, its node is gone) is runnable again,
//! and the actor started for it continues at its last checkpoint, including a
//! completion webhook that was claimed but never marked delivered.
//!
//! The acquire is also the timer poll: a wait whose time has come is fired
//! by the acquire that leases its job. The poll runs each interval; a node
//! also polls at the due time of each wait it released itself, so its own
//! timers fire at their time, not at the next tick.
//!
//! Housekeeping runs when something is due, never on a clock of its own, so
//! an idle node issues its timer poll and nothing else: the purge when the
//! oldest finished job's retention ends, failure events when one is queued
//! (a `NOTIFY`) and when a retry falls due, schedules at the soonest fire
//! time, the job gauges when the metrics are collected, the look for
//! tenants left with no unfinished job after a job ends here.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use actix::prelude::*;

use crate::faults::FailPoint;
use crate::node::actor::{Abort, Finished, JobActor, JobRun, Outcome};
use crate::node::shared::Shared;

/// Look for work now (a job was submitted, an attempt ended, or the timer fired).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Poll;

/// Renew the leases of every job in flight.
#[derive(Message)]
#[rtype(result = "()")]
struct Heartbeat;

/// Send the failure events that are due (any node may): after an attempt
/// here that may have queued one, on a `NOTIFY` of one queued anywhere, and
/// when the soonest pending one falls due.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SendEvents;

/// Failure events one node sends per tick.
const EVENT_BATCH: i64 = 32;

/// The name an acquire passes its failpoint under
/// (`before-commit:acquire`, hit after it read the jobs this node runs and
/// is being handed, before its statement): a test holds an acquire there.
pub const ACQUIRE_FAULT_ID: &str = "*acquire";

/// The name a firing of schedules passes its failpoint under
/// (`after-commit:schedules`, hit after each firing, once it has read when
/// the next schedule is due): a test holds a firing there.
pub const SCHEDULES_FAULT_ID: &str = "*schedules";

/// Purge one small batch of jobs past their retention.
#[derive(Message)]
#[rtype(result = "()")]
struct Purge;

/// Refresh the jobs-by-state and unrunnable gauges (before an OTLP push).
#[derive(Message)]
#[rtype(result = "()")]
struct Gauge;

/// Mark not live the tenants left with no unfinished job (see
/// [`crate::store::Leases::rest_idle_tenants`]): armed by a job that
/// ended here, at most once per [`REST_EVERY`], so an idle node never runs
/// it.
#[derive(Message)]
#[rtype(result = "()")]
struct RestTenants;

/// The least time between two looks for idle tenants.
const REST_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Jobs purged per statement: small, so a purge never holds many locks.
const PURGE_BATCH: i64 = 100;

/// A wait this node released is due: poll. It carries the due time it
/// was armed for; one that is no longer the armed one (a wake-up armed
/// earlier since, while it sat in the mailbox) is ignored.
#[derive(Message)]
#[rtype(result = "()")]
struct Wake(u64);

/// Due times a node keeps to poll at. The latest past this many are
/// dropped; the regular poll still finds their jobs, within its interval.
const MAX_WAKEUPS: usize = 100_000;

/// Run a job intake has just created already leased to this node (see
/// [`crate::node::handoff`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Adopt(pub crate::store::Leased);

/// A hand-off's answer was lost (or its commit is in doubt): the job may
/// be leased to this node with no actor. The next acquire also takes back
/// this node's own leases of jobs no actor here runs, as at start.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReclaimOwn;

/// How many jobs this node is running.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct InFlight;

/// Abort every attempt and stop.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

/// Take no new work (the node drains); attempts in flight carry on.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain;

/// A housekeeping task that runs one at a time: asked for while it runs,
/// it runs once more when it ends.
#[derive(Default)]
struct OneAtATime {
    running: bool,
    again: bool,
}

impl OneAtATime {
    /// Whether to start now; if one runs, it is marked to run again.
    fn start(&mut self) -> bool {
        if self.running {
            self.again = true;
            return false;
        }
        self.running = true;
        true
    }

    /// The run ended: whether it was asked for meanwhile.
    fn end(&mut self) -> bool {
        self.running = false;
        std::mem::take(&mut self.again)
    }
}

/// The per-node supervisor.
pub struct Supervisor {
    shared: Arc<Shared>,
    in_flight: HashMap<String, (i64, Addr<JobActor>)>,
    polling: bool,
    poll_again: bool,
    renewing: bool,
    purging: bool,
    gauging: bool,
    /// A [`RestTenants`] is armed or running.
    resting: bool,
    /// When the last one ran.
    rested_at: Option<std::time::Instant>,
    /// The sweep of failure events (a `SendEvents` that arrives during one
    /// sweeps again after it).
    sending_events: OneAtATime,
    /// The sweep armed for the soonest pending event (a retry, or another
    /// node's send whose mark may lapse).
    events_timer: Option<SpawnHandle>,
    /// The purge armed for when the oldest finished job's retention ends.
    purge_timer: Option<SpawnHandle>,
    /// When that purge is due (`None`: nothing finished was seen).
    purge_due: Option<std::time::Instant>,
    /// Reclaims of this node's own leases asked for (one at start, one per
    /// `ReclaimOwn`) and done: an acquire reclaims while any is pending.
    reclaim_wanted: u64,
    reclaimed: u64,
    stopping: bool,
    /// Actors in flight last reported to the up-down counter.
    reported_in_flight: i64,
    /// When to look for due schedules next.
    schedules_due: SchedulesDue,
    /// The firing of schedules (a `FireSchedules` that arrives during one,
    /// for a schedule created or resumed meanwhile, fires again after it,
    /// whatever it read).
    firing: OneAtATime,
    /// Due times of the waits this node released, earliest first, in
    /// milliseconds since `started` (this process's monotonic clock,
    /// rounded up): one entry per millisecond, however many jobs fall due
    /// in it.
    wakeups: BTreeSet<u64>,
    /// The due time the armed wake-up is for, and its timer.
    wake: Option<(u64, SpawnHandle)>,
    /// The origin of `wakeups`.
    started: std::time::Instant,
}

/// Fire the due schedules (see [`crate::store::schedules`]).
#[derive(Message)]
#[rtype(result = "()")]
struct FireSchedules;

/// When a node looks for due schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SchedulesDue {
    /// At the next poll.
    Now,
    /// At the first poll from then on: the soonest schedule's due time.
    At(std::time::Instant),
    /// No schedule is active: when one is created or resumed (its `NOTIFY`),
    /// or when `LISTEN` reconnects (a `NOTIFY` may have been missed).
    WhenTold,
}

/// `LISTEN` is (re)connected: whatever was announced while it was not is
/// looked for once — new work, schedules, failure events.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Listening;

/// Purge now (see [`crate::node::runtime::Engine::purge_now`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PurgeNow;

/// A schedule was created or resumed somewhere: look at once.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SchedulesChanged;

impl Supervisor {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Supervisor {
            shared,
            in_flight: HashMap::new(),
            polling: false,
            poll_again: false,
            renewing: false,
            purging: false,
            gauging: false,
            resting: false,
            rested_at: None,
            sending_events: OneAtATime::default(),
            events_timer: None,
            purge_timer: None,
            purge_due: None,
            reclaim_wanted: 1,
            reclaimed: 0,
            stopping: false,
            reported_in_flight: 0,
            schedules_due: SchedulesDue::Now,
            firing: OneAtATime::default(),
            wakeups: BTreeSet::new(),
            wake: None,
            started: std::time::Instant::now(),
        }
    }
}

impl Actor for Supervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let config = &self.shared.config;
        ctx.run_interval(config.poll_interval, |_, ctx| ctx.notify(Poll));
        ctx.run_interval(config.lease / 3, |_, ctx| ctx.notify(Heartbeat));
        // Housekeeping runs when something is due, never on a clock of its
        // own: an idle node issues its acquire poll (the timer poll) each
        // interval and nothing else. The purge is armed for when the oldest
        // finished job's retention ends (see `Purge`); schedules are looked
        // at when the soonest is due (see `FireSchedules`); failure events
        // are sent when queued and when a retry falls due (see `SendEvents`).
        // The gauges are read when the metrics are collected: at each
        // `/metrics` scrape (see `api::metrics`), and here before each OTLP
        // push when OTLP metrics are on. Without either, never.
        if let Some(push) = config.telemetry.otlp().filter(|o| o.metrics.is_some()) {
            ctx.run_interval(push.metric_interval, |_, ctx| ctx.notify(Gauge));
            ctx.notify(Gauge);
        }
        // On start, recover whatever this node's previous incarnation held,
        // send the events due, and find when the first purge is due.
        ctx.notify(Poll);
        ctx.notify(SendEvents);
        ctx.notify(Purge);
    }
}

impl Handler<Poll> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: Poll, ctx: &mut Self::Context) {
        // A frozen attempt (failpoint) stands for a paused node: it takes no work.
        if self.stopping || self.frozen() {
            return;
        }
        let schedules_due = match self.schedules_due {
            SchedulesDue::Now => true,
            SchedulesDue::At(at) => std::time::Instant::now() >= at,
            SchedulesDue::WhenTold => false,
        };
        if schedules_due {
            ctx.notify(FireSchedules);
        }
        if self.polling {
            self.poll_again = true;
            return;
        }
        use std::sync::atomic::Ordering::Acquire;
        let gate = &self.shared.gate;
        let room = self.room();
        if room == 0 {
            gate.budget.store(0, std::sync::atomic::Ordering::Release);
            return;
        }
        // The room promised to hand-offs stays theirs while this acquire
        // runs, so the two never add up past `max_in_flight`; the acquire
        // takes the rest, one job at least, so queued work is always seen.
        let promised = gate.budget.load(Acquire).min(room);
        let capacity = (room - promised).max(1);
        self.polling = true;
        let shared = self.shared.clone();
        // Counted, not a flag: a ReclaimOwn that arrives while an acquire
        // runs is served by the next one, never marked done by this one.
        let reclaim_upto = self.reclaim_wanted;
        let reclaim_own = reclaim_upto > self.reclaimed;
        // Never a job this node is still running (its heartbeat may have
        // failed and its lease lapsed): one job, one actor per node.
        // Nor a job being handed to this node whose `Adopt` is on its way.
        let mut running: Vec<String> = self.in_flight.keys().cloned().collect();
        {
            // Read under the lock hand-offs start under: one that starts
            // after this read waits for the reclaim to answer (see
            // `Gate::reclaiming`).
            let handing = self.shared.gate.handing.lock().expect("lock");
            if reclaim_own {
                self.shared
                    .gate
                    .reclaiming
                    .store(true, std::sync::atomic::Ordering::Release);
            }
            running.extend(handing.iter().cloned());
        }
        let acquire = async move {
            // A seam for tests: an acquire held after it read what runs here.
            let _ = shared
                .faults
                .hit(ACQUIRE_FAULT_ID, FailPoint::BeforeCommit("acquire"))
                .await;
            let workflows = shared.registry.runnable();
            shared
                .store
                .leases()
                .acquire(
                    &shared.config.node_id,
                    capacity as i64,
                    shared.config.lease.as_millis() as i64,
                    reclaim_own,
                    Some(&workflows),
                    &running,
                )
                .await
        };
        ctx.spawn(acquire.into_actor(self).map(move |result, act, ctx| {
            act.polling = false;
            if reclaim_own {
                act.shared
                    .gate
                    .reclaiming
                    .store(false, std::sync::atomic::Ordering::Release);
            }
            match result {
                Ok(leased) => {
                    act.reclaimed = act.reclaimed.max(reclaim_upto);
                    let full = leased.len() == capacity;
                    for job in leased {
                        // The start slot this job took frees at a time:
                        // the key's next job is looked for then.
                        if let Some(frees_in) = job.throttle_frees_in {
                            act.wake_at(std::time::Instant::now() + frees_in, ctx);
                        }
                        act.start_job(job, ctx);
                    }
                    // Room left over: nothing runnable waited, so intake may
                    // hand new jobs straight to this node, up to that room.
                    // A full answer means more may wait: the queue first.
                    let left = act.room();
                    act.shared.gate.budget.store(
                        if full { 0 } else { left },
                        std::sync::atomic::Ordering::Release,
                    );
                    if full || act.poll_again {
                        act.poll_again = false;
                        ctx.notify(Poll);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not lease jobs; will retry"),
            }
        }));
    }
}

impl Supervisor {
    /// Jobs this node may still take: `max_in_flight` less those running
    /// and those reserved by hand-offs not yet adopted.
    fn room(&self) -> usize {
        self.shared
            .config
            .max_in_flight
            .saturating_sub(self.in_flight.len())
            .saturating_sub(
                self.shared
                    .gate
                    .reserved
                    .load(std::sync::atomic::Ordering::Acquire),
            )
    }

    /// Reports a change of the number of actors in flight.
    fn report_in_flight(&mut self) {
        self.shared
            .gate
            .running
            .store(self.in_flight.len(), std::sync::atomic::Ordering::Release);
        let now = self.in_flight.len() as i64;
        let delta = now - self.reported_in_flight;
        if delta != 0 {
            self.shared
                .config
                .telemetry
                .metrics()
                .actors_in_flight
                .add(delta, &[]);
            self.reported_in_flight = now;
        }
    }

    /// Whether one of this node's attempts is frozen by a failpoint.
    fn frozen(&self) -> bool {
        let faults = &self.shared.faults;
        faults.any_frozen() && self.in_flight.keys().any(|id| faults.is_frozen(id))
    }

    fn start_job(&mut self, leased: crate::store::Leased, ctx: &mut Context<Self>) {
        let counters = &self.shared.counters;
        counters
            .started
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(previous) = &leased.previous_owner {
            counters
                .takeovers
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.shared
                .config
                .telemetry
                .metrics()
                .lease_takeovers
                .add(1, &[]);
            tracing::info!(job.id = %leased.fence.job_id, previous_owner = %previous, state = %leased.state, "resuming a stalled job from its last checkpoint");
        }
        let Some(workflow) = self
            .shared
            .registry
            .get_version(&leased.workflow, leased.workflow_version)
            .cloned()
        else {
            // Acquire takes only registered workflows; should one slip
            // through, let the lease lapse for a node that has it.
            tracing::error!(job.id = %leased.fence.job_id, workflow = %leased.workflow, version = leased.workflow_version, "workflow version not registered on this node");
            return;
        };
        let (job_id, epoch) = (leased.fence.job_id.clone(), leased.fence.epoch);
        if let Some((old_epoch, old)) = self.in_flight.remove(&job_id) {
            // Acquire skips running jobs, so this is a defect elsewhere; the
            // old attempt must not live on beside the new one.
            tracing::error!(job.id = %job_id, old_epoch, epoch, "job leased again while an attempt runs; aborting the old attempt");
            old.do_send(Abort);
        }
        let run = JobRun::new(leased, workflow, self.shared.clone());
        let addr = JobActor::new(run, ctx.address().recipient()).start();
        self.in_flight.insert(job_id, (epoch, addr));
        self.report_in_flight();
    }
}

impl Handler<Finished> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: Finished, ctx: &mut Self::Context) {
        // New work wakes us by NOTIFY and the poll timer; a finished attempt
        // only matters when it frees a slot a full node had none of.
        let was_full = self.in_flight.len() >= self.shared.config.max_in_flight;
        if self
            .in_flight
            .get(&msg.job_id)
            .is_some_and(|(e, _)| *e == msg.epoch)
        {
            self.in_flight.remove(&msg.job_id);
            self.report_in_flight();
        }
        // A job that ended (or was cancelled under its attempt) may have
        // been its tenant's last: look at once, then at most once per
        // `REST_EVERY` (a node that finishes nothing never looks).
        if matches!(
            msg.outcome,
            Outcome::Acked | Outcome::Dead | Outcome::LeaseLost
        ) && !self.resting
        {
            self.resting = true;
            let next = self.rested_at.map_or(std::time::Duration::ZERO, |at| {
                (at + REST_EVERY).saturating_duration_since(std::time::Instant::now())
            });
            ctx.notify_later(RestTenants, next);
        }
        if msg.outcome == Outcome::LeaseLost {
            self.shared
                .counters
                .lease_lost
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // An attempt that may have queued an event (a death) or that ended
        // unsure (its kill may have committed): sent from here at once,
        // without waiting on the NOTIFY (an approval's `job.waiting` comes
        // by its NOTIFY alone, so a burst of sleeps sweeps for nothing).
        if !matches!(
            msg.outcome,
            Outcome::Acked | Outcome::Rescheduled | Outcome::Drained | Outcome::Waiting { .. }
        ) {
            ctx.notify(SendEvents);
        }
        // A finished job is purged when its retention ends.
        match msg.outcome {
            Outcome::Acked => self.purge_within(self.shared.config.retention, ctx),
            Outcome::Dead => self.purge_within(self.shared.config.dead_retention, ctx),
            _ => {}
        }
        tracing::debug!(job.id = %msg.job_id, outcome = ?msg.outcome, "attempt ended");
        if let Outcome::Waiting { due: Some(due) } = msg.outcome {
            self.wake_at(due, ctx);
        }
        if was_full {
            ctx.notify(Poll);
        }
    }
}

impl Supervisor {
    /// Polls at `due`, besides the regular poll. `due` is when the wait is
    /// due by the database's clock (the acquire takes jobs whose `run_at <=
    /// now()`), read off this process's monotonic clock, so the node's own
    /// clock may differ from the database's. A wake-up whose poll takes
    /// nothing (the node is full, the acquire fails) is not repeated: the
    /// regular poll fires the timer, within its interval.
    fn wake_at(&mut self, due: std::time::Instant, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        let since = due.saturating_duration_since(self.started);
        // Rounded up to the millisecond: never before `due`.
        let at = since.as_micros().div_ceil(1000) as u64;
        self.wakeups.insert(at);
        if self.wakeups.len() > MAX_WAKEUPS {
            self.wakeups.pop_last();
        }
        self.arm_wake(ctx);
    }

    /// Arms one timer, for the earliest due time kept.
    fn arm_wake(&mut self, ctx: &mut Context<Self>) {
        let Some(&next) = self.wakeups.first() else {
            return;
        };
        if let Some((armed, handle)) = self.wake {
            if armed <= next {
                return;
            }
            // If it has fired already, its `Wake` is ignored: see `Wake`.
            ctx.cancel_future(handle);
        }
        let at = self.started + std::time::Duration::from_millis(next);
        let delay = at.saturating_duration_since(std::time::Instant::now());
        let handle = ctx.run_later(delay, move |_, ctx| ctx.notify(Wake(next)));
        self.wake = Some((next, handle));
    }
}

impl Handler<Wake> for Supervisor {
    type Result = ();

    fn handle(&mut self, Wake(at): Wake, ctx: &mut Self::Context) {
        if self.wake.is_none_or(|(armed, _)| armed != at) {
            return;
        }
        self.wake = None;
        if self.stopping {
            self.wakeups.clear();
            return;
        }
        let now = self.started.elapsed().as_millis() as u64;
        while self.wakeups.first().is_some_and(|due| *due <= now) {
            self.wakeups.pop_first();
        }
        ctx.notify(Poll);
        self.arm_wake(ctx);
    }
}

impl Handler<Heartbeat> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: Heartbeat, ctx: &mut Self::Context) {
        if self.renewing || self.in_flight.is_empty() {
            return;
        }
        self.renewing = true;
        let faults = &self.shared.faults;
        let held: Vec<(String, i64)> = self
            .in_flight
            .iter()
            .filter(|(id, _)| !faults.is_frozen(id))
            .map(|(id, (e, _))| (id.clone(), *e))
            .collect();
        let shared = self.shared.clone();
        let renew = async move {
            let lease_ms = shared.config.lease.as_millis() as i64;
            let renewal = shared
                .store
                .leases()
                .renew(&shared.config.node_id, &held, lease_ms)
                .await;
            (held, renewal)
        };
        ctx.spawn(renew.into_actor(self).map(|(held, renewal), act, _| {
            act.renewing = false;
            match renewal {
                Ok(renewal) => {
                    let counters = &act.shared.counters;
                    counters
                        .renewals
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    counters
                        .renewed_leases
                        .fetch_add(renewal.renewed as u64, std::sync::atomic::Ordering::Relaxed);
                    for id in renewal.lost {
                        // Only abort the attempt we asked about, not a newer one.
                        let asked = held.iter().find(|(h, _)| *h == id).map(|(_, e)| *e);
                        if let Some((epoch, addr)) = act.in_flight.get(&id) {
                            if Some(*epoch) == asked {
                                tracing::warn!(job.id = %id, "lease lost; stopping the attempt");
                                addr.do_send(Abort);
                                act.in_flight.remove(&id);
                                act.report_in_flight();
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "lease renewal failed; will retry"),
            }
        }));
    }
}

impl Handler<Purge> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: Purge, ctx: &mut Self::Context) {
        if self.purging || self.stopping {
            return;
        }
        self.purging = true;
        if let Some(armed) = self.purge_timer.take() {
            ctx.cancel_future(armed);
        }
        self.purge_due = None;
        let shared = self.shared.clone();
        let purge = async move {
            let retention_ms = shared.config.retention.as_millis() as i64;
            let dead_retention_ms = shared.config.dead_retention.as_millis() as i64;
            let store = &shared.store;
            let n = store
                .retention()
                .purge_finished_keeping_dead(retention_ms, dead_retention_ms, PURGE_BATCH)
                .await?;
            if n as i64 == PURGE_BATCH {
                return Ok((n, Some(std::time::Duration::ZERO)));
            }
            let next = store
                .retention()
                .next_purge_in(retention_ms, dead_retention_ms)
                .await?;
            Ok::<_, crate::error::StoreError>((n, next))
        };
        ctx.spawn(purge.into_actor(self).map(|result, act, ctx| {
            act.purging = false;
            let config = &act.shared.config;
            // Nothing finished yet (or nothing this node could see): looked
            // at again within the retention at the latest, for a job another
            // node finished and did not purge (it stopped); this node's own
            // finished jobs arm their purge themselves (see `Finished`).
            let longest = config.retention.min(config.dead_retention);
            let delay = match result {
                // A full batch: more may be waiting.
                Ok((n, _)) if n as i64 == PURGE_BATCH => std::time::Duration::ZERO,
                Ok((n, next)) => {
                    if n > 0 {
                        tracing::info!(purged = n, "purged jobs past their retention");
                    }
                    match next {
                        // Past due but not purged: kept (a child of a live
                        // parent) or another node's purge has it. Again in
                        // a minute of polls, while such rows are there.
                        Some(next) if next.is_zero() => config.poll_interval * 60,
                        Some(next) => next.min(longest),
                        None => longest,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "purge failed; will retry");
                    config.poll_interval * 60
                }
            };
            act.purge_within(delay, ctx);
        }));
    }
}

impl Supervisor {
    /// Purges at `delay` from now at the latest (an earlier purge armed
    /// stays).
    fn purge_within(&mut self, delay: std::time::Duration, ctx: &mut Context<Self>) {
        if self.stopping {
            return;
        }
        let due = std::time::Instant::now() + delay;
        if self.purge_due.is_some_and(|armed| armed <= due) {
            return;
        }
        if let Some(armed) = self.purge_timer.take() {
            ctx.cancel_future(armed);
        }
        self.purge_due = Some(due);
        self.purge_timer = Some(ctx.run_later(delay, |_, ctx| ctx.notify(Purge)));
    }
}

impl Handler<PurgeNow> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: PurgeNow, ctx: &mut Self::Context) {
        ctx.notify(Purge);
    }
}

impl Handler<FireSchedules> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: FireSchedules, ctx: &mut Self::Context) {
        if self.stopping {
            return;
        }
        // What a firing under way reads of the schedules may predate the
        // request (a schedule created or resumed meanwhile): it looks again
        // when it ends.
        if !self.firing.start() {
            return;
        }
        // Polls during the firing do not ask again; its result says when.
        self.schedules_due = SchedulesDue::WhenTold;
        let shared = self.shared.clone();
        let fireable: Vec<crate::store::schedules::Fireable> = shared
            .registry
            .names()
            .filter_map(|name| {
                Some(crate::store::schedules::Fireable {
                    workflow: name.to_owned(),
                    version: shared.registry.get(name)?.version() as i32,
                    notify_failures: shared.registry.failure_events(name),
                })
            })
            .collect();
        // Looked at again when the next is due; with none active, when
        // one is created or resumed (its NOTIFY) or LISTEN reconnects (see
        // `Listening`): an idle node never looks on a clock of its own.
        ctx.spawn(
            async move {
                let backlog = shared.config.max_backlog_per_token;
                let fired = shared.store.schedules().fire(&fireable, backlog).await;
                // A seam for tests: a firing held after it read when the next is due.
                let _ = shared
                    .faults
                    .hit(SCHEDULES_FAULT_ID, FailPoint::AfterCommit("schedules"))
                    .await;
                fired
            }
            .into_actor(self)
            .map(move |result, act, ctx| {
                if act.firing.end() {
                    ctx.notify(FireSchedules);
                }
                let now = std::time::Instant::now();
                act.schedules_due = match result {
                    Ok(fired) => {
                        for (workflow, made) in &fired.by_workflow {
                            crate::attempt_spans::count_intake(
                                &act.shared.config.telemetry,
                                workflow,
                                "created",
                                *made as u64,
                            );
                        }
                        if fired.jobs > 0 {
                            tracing::info!(
                                jobs = fired.jobs,
                                schedules = fired.schedules,
                                "schedules fired"
                            );
                            ctx.notify(Poll);
                        }
                        if fired.schedules > 0 && fired.next_in == Some(std::time::Duration::ZERO) {
                            ctx.notify(FireSchedules); // a full batch: more are due
                        }
                        match fired.next_in {
                            Some(next) => SchedulesDue::At(now + next),
                            None => SchedulesDue::WhenTold,
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not fire schedules; will retry");
                        SchedulesDue::At(now + act.shared.config.poll_interval)
                    }
                };
            }),
        );
    }
}

impl Handler<SchedulesChanged> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: SchedulesChanged, ctx: &mut Self::Context) {
        self.schedules_due = SchedulesDue::Now;
        ctx.notify(FireSchedules);
    }
}

impl Handler<Listening> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: Listening, ctx: &mut Self::Context) {
        self.schedules_due = SchedulesDue::Now;
        ctx.notify(FireSchedules);
        ctx.notify(SendEvents);
        ctx.notify(Poll);
    }
}

impl Handler<Gauge> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: Gauge, ctx: &mut Self::Context) {
        if self.gauging || self.stopping {
            return;
        }
        self.gauging = true;
        let shared = self.shared.clone();
        let gauge = async move {
            crate::node::shared::refresh_gauges(
                &shared.store,
                &shared.registry,
                &shared.config.telemetry,
            )
            .await
        };
        ctx.spawn(gauge.into_actor(self).map(|(), act, _| act.gauging = false));
    }
}

impl Handler<RestTenants> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: RestTenants, ctx: &mut Self::Context) {
        if self.stopping {
            return;
        }
        let store = self.shared.store.clone();
        let rest = async move {
            if let Err(e) = store.leases().rest_idle_tenants().await {
                tracing::warn!(error = %e, "could not mark idle tenants; the acquire still reads them");
            }
        };
        ctx.spawn(rest.into_actor(self).map(|(), act, _| {
            act.resting = false;
            act.rested_at = Some(std::time::Instant::now());
        }));
    }
}

impl Handler<SendEvents> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: SendEvents, ctx: &mut Self::Context) {
        if self.stopping {
            return;
        }
        // Queued during a sweep, perhaps after its claim: it sweeps again.
        if !self.sending_events.start() {
            return;
        }
        if let Some(armed) = self.events_timer.take() {
            ctx.cancel_future(armed);
        }
        let shared = self.shared.clone();
        let sweep = async move {
            let n = send_events(&shared).await?;
            if n as i64 == EVENT_BATCH {
                // A full batch: more may be due.
                return Ok(Some(std::time::Duration::ZERO));
            }
            shared.store.events().next_in().await
        };
        ctx.spawn(sweep.into_actor(self).map(|result, act, ctx| {
            let again = act.sending_events.end();
            let poll = act.shared.config.poll_interval;
            let next = match result {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "could not send failure events; will retry");
                    Some(poll * 10)
                }
            };
            if again {
                ctx.notify(SendEvents);
            } else if let Some(next) = next {
                // The soonest pending event: a retry's backoff, or another
                // node's send whose mark lapses should that node die. Due
                // now but not claimed (another node's claim locked it): a
                // poll interval on, not a spin.
                let delay = if next.is_zero() { poll } else { next };
                act.events_timer = Some(ctx.run_later(delay, |_, ctx| ctx.notify(SendEvents)));
            }
        }));
    }
}

/// Sends the failure events due (one batch); returns how many it claimed.
async fn send_events(shared: &Shared) -> Result<usize, crate::error::StoreError> {
    let config = &shared.config;
    let in_flight_ms =
        (config.webhook_timeout + std::time::Duration::from_secs(5)).as_millis() as i64;
    let events = shared
        .store
        .events()
        .claim(EVENT_BATCH, in_flight_ms)
        .await?;
    let n = events.len();
    for event in events {
        // Read before the send is marked begun (see the actor's delivery).
        let secret = shared.signing_secret(event.owner_token).await?;
        if !shared
            .store
            .events()
            .mark_sending(&event, in_flight_ms)
            .await?
        {
            tracing::debug!(key = %event.idempotency_key, "another node claimed this event meanwhile");
            continue;
        }
        let sender = crate::net::webhook::Sender {
            client: &shared.client,
            guard: &config.url_guard,
            secret: secret.as_deref(),
            timeout: config.webhook_timeout,
        };
        let traceparent = crate::rules::traceparent::TraceParent::new_root().to_string();
        let sent = crate::net::webhook::send(
            sender,
            &event.url,
            &event.idempotency_key,
            &event.body,
            &traceparent,
            &shared.faults,
            &event.job_id,
        )
        .await;
        let metrics = config.telemetry.metrics();
        match sent {
            Ok(status) => {
                metrics.delivery(onceflow_observability::names::OUTCOME_DELIVERED);
                shared
                    .store
                    .events()
                    .outcome(
                        &event.idempotency_key,
                        event.attempts,
                        Some(i32::from(status)),
                        None,
                        None,
                    )
                    .await?;
            }
            Err(crate::net::outbound::PostError::Injected(_)) => {
                // A failpoint after the send: the mark expires, it is sent again.
            }
            Err(crate::net::outbound::PostError::Failed(failure)) => {
                let attempts = u32::try_from(event.attempts).unwrap_or(1).max(1);
                let policy = config.webhook_retry;
                let retry_in = (failure.is_retryable() && !policy.exhausted(attempts))
                    .then(|| policy.delay(attempts, failure.retry_after()));
                metrics.delivery(if retry_in.is_some() {
                    onceflow_observability::names::OUTCOME_RETRIED
                } else {
                    onceflow_observability::names::OUTCOME_DEAD
                });
                shared
                    .store
                    .events()
                    .outcome(
                        &event.idempotency_key,
                        event.attempts,
                        failure.status().map(i32::from),
                        Some(&failure.envelope()),
                        retry_in,
                    )
                    .await?;
            }
        }
    }
    Ok(n)
}

impl Handler<Adopt> for Supervisor {
    type Result = ();

    fn handle(&mut self, Adopt(leased): Adopt, ctx: &mut Self::Context) {
        let leased_id = leased.fence.job_id.clone();
        // Counted in `in_flight` before the reservation is given back, so
        // the room it held is never offered twice. Stopping, the job is not
        // started: its lease lapses and any node resumes it.
        if self.stopping {
            tracing::debug!(job.id = %leased.fence.job_id, "stopping: a handed-off job is left to its lease");
        } else if self.in_flight.contains_key(&leased.fence.job_id) {
            // Adopted too late: its lease lapsed and an acquire here already
            // runs the job under a newer epoch; this one is fenced out.
            tracing::warn!(job.id = %leased.fence.job_id, epoch = leased.fence.epoch, "a handed-off job already runs here under a newer lease; not started again");
        } else {
            self.start_job(leased, ctx);
        }
        self.shared
            .gate
            .reserved
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.shared
            .gate
            .handing
            .lock()
            .expect("lock")
            .remove(&leased_id);
    }
}

impl Handler<ReclaimOwn> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: ReclaimOwn, ctx: &mut Self::Context) {
        // Safe against a hand-off still on its way to `Adopt` (it is in
        // `handing`, which the acquire skips) and against one that starts
        // while the acquire runs (it is not handed: `Gate::reclaiming`).
        self.reclaim_wanted += 1;
        ctx.notify(Poll);
    }
}

impl Handler<InFlight> for Supervisor {
    type Result = usize;
    fn handle(&mut self, _: InFlight, _: &mut Self::Context) -> usize {
        self.in_flight.len()
    }
}

/// Job `0` was cancelled (on any node): its attempt here, if any, stops at
/// once, wherever it waits (a provider limit, a model call, a step).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Cancelled(pub String);

impl Handler<Cancelled> for Supervisor {
    type Result = ();
    fn handle(&mut self, Cancelled(id): Cancelled, ctx: &mut Self::Context) {
        // Any attempt of a cancelled job is fenced out (the cancel bumped
        // the epoch, and a finished job is never leased again), so whatever
        // epoch runs here stops.
        let was_full = self.in_flight.len() >= self.shared.config.max_in_flight;
        if let Some((_, addr)) = self.in_flight.remove(&id) {
            tracing::info!(job.id = %id, "cancelled; stopping the attempt");
            addr.do_send(Abort);
            self.report_in_flight();
            if was_full {
                ctx.notify(Poll);
            }
        }
        // The cancel may have queued a job.cancelled event, and the job is
        // purged when its retention ends.
        ctx.notify(SendEvents);
        self.purge_within(self.shared.config.retention, ctx);
    }
}

impl Handler<Drain> for Supervisor {
    type Result = ();
    fn handle(&mut self, _: Drain, _: &mut Self::Context) {
        self.stopping = true;
        self.shared
            .gate
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Handler<Shutdown> for Supervisor {
    type Result = ();
    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        self.stopping = true;
        self.shared
            .gate
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        for (_, (_, addr)) in self.in_flight.drain() {
            addr.do_send(Abort);
        }
        self.report_in_flight();
        ctx.stop();
    }
}
