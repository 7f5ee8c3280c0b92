//! The checkpoints written through [`Batcher`]s: `delivered`, `acked`, and
//! the journaling of a model call's answer. Each is one statement over
//! arrays for a whole batch, with the same guard as the single-job form
//! (state and lease epoch per row), the job rows locked in id order first.

use std::collections::HashSet;
use std::sync::Arc;

use diesel::sql_types::{Array, BigInt, Integer, Jsonb, Nullable, Text};
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use super::batch::{Batcher, ForJob};
use super::lease::IdRow;
use super::sql::sql;
use super::{Checkpoint, Fence, Store};
use crate::db::Db;
use crate::error::StoreError;

/// `delivered → acked` for one job.
pub(crate) struct Ack {
    pub(crate) fence: Fence,
}

/// `claimed → delivered` for one job, with its outbox row.
pub(crate) struct Delivered {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) status: i32,
}

/// A model call's answer, journaled under its key (fenced; no state change).
pub(crate) struct ModelAnswer {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) response: Value,
    pub(crate) usage: (Option<i32>, Option<i32>),
}

impl ForJob for Ack {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}
impl ForJob for Delivered {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}
impl ForJob for ModelAnswer {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// The batchers of one store.
#[derive(Debug)]
pub(crate) struct Batches {
    pub(crate) ack: Batcher<Ack, Checkpoint>,
    pub(crate) delivered: Batcher<Delivered, Checkpoint>,
    pub(crate) model_answer: Batcher<ModelAnswer, Checkpoint>,
}

impl Batches {
    pub(crate) fn start(db: &Db) -> Arc<Batches> {
        Arc::new(Batches {
            ack: Batcher::start(db, Box::new(|pool, r| Box::pin(ack(pool, r)))),
            delivered: Batcher::start(db, Box::new(|pool, r| Box::pin(delivered(pool, r)))),
            model_answer: Batcher::start(db, Box::new(|pool, r| Box::pin(model_answer(pool, r)))),
        })
    }
}

/// The job-row lock, in id order, that every batched statement takes first
/// (`$1` is the batch's job ids).
macro_rules! lock_in_order {
    () => {
        "locked AS MATERIALIZED (SELECT id FROM jobs WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE), "
    };
}

/// Moved for the rows the statement returned; for the others, why not (rare).
async fn outcomes<R: ForJob>(
    conn: &mut AsyncPgConnection,
    requests: &[R],
    moved: Vec<IdRow>,
) -> Result<Vec<Checkpoint>, StoreError> {
    let moved: HashSet<String> = moved.into_iter().map(|r| r.id).collect();
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        out.push(if moved.contains(r.job_id()) {
            Checkpoint::Moved
        } else {
            Store::why_not(conn, r.fence()).await?
        });
    }
    Ok(out)
}

fn fences<R: ForJob>(requests: &[R]) -> (Vec<String>, Vec<i64>, Vec<i32>, Vec<String>) {
    let mut ids = Vec::with_capacity(requests.len());
    let mut epochs = Vec::with_capacity(requests.len());
    let mut attempts = Vec::with_capacity(requests.len());
    let mut workers = Vec::with_capacity(requests.len());
    for r in requests {
        let f = r.fence();
        ids.push(f.job_id.clone());
        epochs.push(f.epoch);
        attempts.push(f.attempt);
        workers.push(f.worker.clone());
    }
    (ids, epochs, attempts, workers)
}

async fn ack(
    pool: Pool<AsyncPgConnection>,
    requests: Vec<Ack>,
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, attempts, workers) = fences(&requests);
    let mut conn = pool.get().await?;
    let moved: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[], $4::text[]) \
             AS i(id, epoch, attempt, worker)), \
",
        lock_in_order!(),
        "         moved AS ( \
             UPDATE jobs j SET state = 'acked', updated_at = now(), finished_at = now(), \
                 lease_owner = NULL, lease_expires_at = NULL \
             FROM input i \
             WHERE j.id = i.id AND j.state = 'delivered' AND j.lease_epoch = i.epoch \
               AND EXISTS (SELECT 1 FROM locked) \
             RETURNING j.id, i.attempt, i.worker), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT id, 'acked', attempt, worker FROM moved) \
         SELECT id FROM moved"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Text>, _>(&workers)
    .load(&mut conn)
    .await?;
    outcomes(&mut conn, &requests, moved).await
}

async fn delivered(
    pool: Pool<AsyncPgConnection>,
    requests: Vec<Delivered>,
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, attempts, workers) = fences(&requests);
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let statuses: Vec<i32> = requests.iter().map(|r| r.status).collect();
    let mut conn = pool.get().await?;
    let moved: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[], $4::text[], \
             $5::text[], $6::int[]) AS i(id, epoch, attempt, worker, key, status)), \
",
        lock_in_order!(),
        "         moved AS ( \
             UPDATE jobs j SET state = 'delivered', updated_at = now() \
             FROM input i \
             WHERE j.id = i.id AND j.state = 'claimed' AND j.lease_epoch = i.epoch \
               AND EXISTS (SELECT 1 FROM locked) \
             RETURNING j.id, i.attempt, i.worker, i.key, i.status), \
         sent AS ( \
             UPDATE outbox o SET status = 'delivered', delivered_at = now(), last_status = m.status, \
                 in_flight_until = NULL, updated_at = now() \
             FROM moved m WHERE o.idempotency_key = m.key AND o.status = 'claimed'), \
         history AS ( \
             INSERT INTO job_history (job_id, state, attempt, worker) \
             SELECT id, 'delivered', attempt, worker FROM moved) \
         SELECT id FROM moved"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Text>, _>(&workers)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Integer>, _>(&statuses)
    .load(&mut conn)
    .await?;
    outcomes(&mut conn, &requests, moved).await
}

async fn model_answer(
    pool: Pool<AsyncPgConnection>,
    requests: Vec<ModelAnswer>,
) -> Result<Vec<Checkpoint>, StoreError> {
    let (ids, epochs, _, _) = fences(&requests);
    let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    let responses: Vec<&Value> = requests.iter().map(|r| &r.response).collect();
    let input_tokens: Vec<Option<i32>> = requests.iter().map(|r| r.usage.0).collect();
    let output_tokens: Vec<Option<i32>> = requests.iter().map(|r| r.usage.1).collect();
    let mut conn = pool.get().await?;
    let written: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::jsonb[], \
             $5::int[], $6::int[]) AS i(id, epoch, key, response, input_tokens, output_tokens)), \
",
        lock_in_order!(),
        "         fenced AS ( \
             SELECT i.* FROM input i JOIN jobs j ON j.id = i.id AND j.lease_epoch = i.epoch \
             WHERE EXISTS (SELECT 1 FROM locked)) \
         UPDATE model_calls m SET status = 'completed', response = f.response, \
             input_tokens = f.input_tokens, output_tokens = f.output_tokens, \
             in_flight_until = NULL, last_error = NULL, updated_at = now() \
         FROM fenced f WHERE m.idempotency_key = f.key \
         RETURNING f.id"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Jsonb>, _>(&responses)
    .bind::<Array<Nullable<Integer>>, _>(&input_tokens)
    .bind::<Array<Nullable<Integer>>, _>(&output_tokens)
    .load(&mut conn)
    .await?;
    // No state moves here: a row not written means the lease is gone.
    let written: HashSet<String> = written.into_iter().map(|r| r.id).collect();
    Ok(requests
        .iter()
        .map(|r| {
            if written.contains(r.job_id()) {
                Checkpoint::Moved
            } else {
                Checkpoint::LeaseLost
            }
        })
        .collect())
}
