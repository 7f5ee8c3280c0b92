//! Child jobs: a job that a workflow starts (`ctx.spawn`) and may wait for
//! (`ctx.join`).
//!
//! A child is inserted by intake's own statement, in a transaction that
//! first holds the parent's fence: a cancelled or taken-over attempt
//! starts no child, and the id (derived from the parent's id and the
//! spawn's name) makes a repeat find the child instead of making another.
//! A join is a wait (`waits`, kind `children`): while a child is live, the
//! parent is released with `waiting` saying so; a child that finishes makes
//! its waiting parent due at once (a trigger, `onceflow_child_finished`),
//! and the join's outcome — every child's state, result or error — is
//! journaled the first time all are over (or the join times out), so a
//! replay never reads the children again.

use diesel::sql_types::{Array, Bool, Integer, Jsonb, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, RunQueryDsl};
use serde_json::Value;

use super::group_writes::{intake_on, NewRow};
use super::rows::NEW_JOB_CHANNEL;
use super::sql::sql;
use super::waits::WaitStep;
use super::Waits;
use super::{Fence, Store};
use crate::error::StoreError;
use crate::rules::wait_machine::{decide, ChildOutcome, Decision, Seen, WaitKind, Waiting};

/// What starting a child did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Spawned {
    /// Inserted now.
    Created,
    /// This parent started it before, with the same request.
    Existing,
    /// The id is taken by another job, or by this parent's child with
    /// another request (the body changed under the same name).
    Conflict,
    /// The attempt no longer holds the parent: nothing was written.
    LeaseLost,
}

/// Most children one join shows in the parent's `waiting`.
const SHOWN_PENDING: usize = 100;

impl Waits<'_> {
    /// Starts child `row` of the job `fence` holds (see the module's
    /// documentation).
    pub(crate) async fn spawn_child(
        self,
        fence: &Fence,
        row: NewRow,
    ) -> Result<Spawned, StoreError> {
        retrying!(self, "spawn_child", async || {
            let mut conn = self.db().conn().await?;
            let row = row.clone();
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(Spawned::LeaseLost);
                }
                let hash = row.request_hash.clone();
                let id = row.id.clone();
                if intake_on(conn, std::slice::from_ref(&row))
                    .await?
                    .remove(0)
                    .is_some()
                {
                    return Ok(Spawned::Created);
                }
                #[derive(QueryableByName)]
                struct Stored {
                    #[diesel(sql_type = Bool)]
                    same: bool,
                }
                let stored: Vec<Stored> = sql(
                    "SELECT request_hash = $2 AND parent_id IS NOT DISTINCT FROM $3 \
                         AND parent_incarnation IS NOT DISTINCT FROM $4 AS same \
                     FROM jobs WHERE id = $1",
                )
                .bind::<Text, _>(&id)
                .bind::<Text, _>(&hash)
                .bind::<Text, _>(&fence.job_id)
                .bind::<Integer, _>(fence.incarnation)
                .load(conn)
                .await?;
                Ok(if stored.iter().any(|s| s.same) {
                    Spawned::Existing
                } else {
                    Spawned::Conflict
                })
            })
            .await
        })
        .await
    }

    /// Reaches join `key` (named `name`) of `children` under the attempt's
    /// fence: journals it the first time (due `timeout_ms` from now, by the
    /// database's clock), returns its journaled outcome when every child is
    /// over or the join timed out, or releases the parent until a child
    /// finishes.
    pub(crate) async fn join_children(
        self,
        fence: &Fence,
        key: &str,
        name: &str,
        children: &[String],
        timeout_ms: i64,
    ) -> Result<WaitStep, StoreError> {
        #[derive(QueryableByName)]
        struct ChildRow {
            #[diesel(sql_type = Text)]
            id: String,
            #[diesel(sql_type = Text)]
            state: String,
            #[diesel(sql_type = Bool)]
            finished: bool,
            #[diesel(sql_type = Nullable<Jsonb>)]
            result: Option<Value>,
            #[diesel(sql_type = Nullable<Jsonb>)]
            error: Option<Value>,
            #[diesel(sql_type = Nullable<Text>)]
            dead_reason: Option<String>,
            #[diesel(sql_type = Bool)]
            queued: bool,
        }
        retrying!(self, "join_children", async || {
            let mut conn = self.db().conn().await?;
            conn.transaction::<_, StoreError, _>(async move |conn| {
                if !Store::hold_fence(conn, fence).await? {
                    return Ok(WaitStep::LeaseLost);
                }
                let wait = super::waits::journal_wait(
                    conn,
                    &fence.job_id,
                    key,
                    "children",
                    name,
                    Some(timeout_ms),
                    None,
                )
                .await?;
                // Journaled before: the machine returns it as it is.
                let journaled = super::waits::journaled_outcome(wait.outcome.as_ref())?;
                if journaled.is_some() {
                    if let Decision::Over(outcome) =
                        decide(WaitKind::Children, journaled, Seen::default())
                    {
                        return Ok(WaitStep::Done(outcome));
                    }
                }
                // The children's rows are share-locked: a child finishing
                // now waits for this commit, so its trigger sees the parent
                // released (a leased parent's committed row does not match
                // the trigger's WHERE, which would skip it without waiting),
                // and one that finished first is read finished.
                let rows: Vec<ChildRow> = sql(
                    "SELECT j.id, j.state::text AS state, j.finished_at IS NOT NULL AS finished, \
                         r.output AS result, j.last_error AS error, j.dead_reason, \
                         (j.lease_expires_at IS NULL OR j.lease_expires_at < clock_timestamp()) \
                             AND j.run_at <= now() AS queued \
                     FROM jobs j LEFT JOIN results r ON r.job_id = j.id \
                     WHERE j.id = ANY($1) AND j.parent_id = $2 AND j.parent_incarnation = $3 \
                     ORDER BY j.id FOR SHARE OF j",
                )
                .bind::<Array<Text>, _>(children)
                .bind::<Text, _>(&fence.job_id)
                .bind::<Integer, _>(fence.incarnation)
                .load(conn)
                .await?;
                let mut by_id: std::collections::HashMap<&str, &ChildRow> =
                    rows.iter().map(|r| (r.id.as_str(), r)).collect();
                let pending: Vec<&String> = children
                    .iter()
                    .filter(|id| by_id.get(id.as_str()).is_some_and(|r| !r.finished))
                    .collect();
                // An acquire that met a queued child's row under this
                // share lock skipped it (`SKIP LOCKED`): it is announced
                // again at this commit, or it would wait for the next poll.
                if pending
                    .iter()
                    .any(|id| by_id.get(id.as_str()).is_some_and(|r| r.queued))
                {
                    sql("SELECT pg_notify($1, $2)")
                        .bind::<Text, _>(NEW_JOB_CHANNEL)
                        .bind::<Text, _>(&fence.job_id)
                        .execute(conn)
                        .await?;
                }
                let standing: Vec<ChildOutcome> = children
                    .iter()
                    .map(|id| match by_id.remove(id.as_str()) {
                        None => ChildOutcome {
                            id: id.clone(),
                            state: "missing".into(),
                            finished: None,
                            result: None,
                            error: None,
                            dead_reason: None,
                        },
                        Some(r) => ChildOutcome {
                            id: r.id.clone(),
                            state: r.state.clone(),
                            finished: Some(r.finished),
                            result: r.result.clone(),
                            error: r.error.clone(),
                            dead_reason: r.dead_reason.clone(),
                        },
                    })
                    .collect();
                let seen = Seen {
                    signal: None,
                    children: Some((standing, pending.is_empty())),
                    due: wait.due,
                };
                if let Decision::Over(outcome) = decide(WaitKind::Children, None, seen) {
                    super::waits::close_wait(conn, &fence.job_id, key, &outcome).await?;
                    return Ok(WaitStep::Done(outcome));
                }
                let waiting = Waiting::Children {
                    name: name.to_owned(),
                    until: wait.until,
                    children: pending
                        .iter()
                        .take(SHOWN_PENDING)
                        .map(|id| (*id).clone())
                        .collect(),
                    pending: pending.len(),
                };
                super::waits::release_until(conn, fence, &waiting, wait.until).await?;
                Ok(WaitStep::Waiting {
                    until: wait.until,
                    due: super::waits::due_in(wait.left_ms),
                })
            })
            .await
        })
        .await
    }

    /// Whether job `id` is a child of this life of the job `parent` runs,
    /// running `workflow` on `input`: a replay finds the child it made,
    /// whatever this node has registered (another input is no find:
    /// `child_conflict` stays).
    pub(crate) async fn is_child_of(
        self,
        id: &str,
        parent: &Fence,
        workflow: &str,
        input: &Value,
    ) -> Result<bool, StoreError> {
        #[derive(QueryableByName)]
        struct Found {
            #[diesel(sql_type = Bool)]
            found: bool,
        }
        let mut conn = self.db().conn().await?;
        let found: Found = sql(
            "SELECT EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND parent_id = $2 \
                 AND parent_incarnation = $5 AND workflow = $3 AND request->'input' = $4) AS found",
        )
        .bind::<Text, _>(id)
        .bind::<Text, _>(&parent.job_id)
        .bind::<Text, _>(workflow)
        .bind::<Jsonb, _>(input)
        .bind::<Integer, _>(parent.incarnation)
        .get_result(&mut conn)
        .await?;
        Ok(found.found)
    }
}
