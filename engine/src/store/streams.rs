//! The stream journal (`stream_events`): the chunks of streamed model
//! answers, group-committed and fenced like every other write, and the
//! events a watcher of a job reads (`GET /v1/jobs/{id}/events`): its chunks,
//! resets and state changes in one increasing sequence of ids.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::batch::ForJob;
use super::lease::{lock_in_order, IdRow};
use super::sql::sql;
use super::{Checkpoint, Fence, Store};
use crate::error::StoreError;

/// The channel a committed batch of chunks is announced on (the job id as
/// payload), so watchers on other nodes read it at once.
pub const STREAM_CHANNEL: &str = "onceflow_stream";

/// One row of a stream's journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRow {
    /// The offset in its generation (`-1` for a reset).
    pub offset: i32,
    /// `chunk` or `reset`.
    pub kind: &'static str,
    /// The chunk's text, or the reset's reason.
    pub text: String,
}

/// Chunks (and resets) of one model call's stream, journaled in one write.
#[derive(Clone)]
pub(crate) struct StreamWrite {
    pub(crate) fence: Fence,
    pub(crate) key: String,
    pub(crate) generation: i32,
    pub(crate) rows: Vec<StreamRow>,
}

impl ForJob for StreamWrite {
    fn fence(&self) -> &Fence {
        &self.fence
    }
}

/// Writes the chunks of many streams in one statement, each job's rows only
/// while its lease epoch holds (the job rows locked in id order first, as
/// every batch does), and announces each job on [`STREAM_CHANNEL`].
pub(crate) async fn stream_on(
    conn: &mut AsyncPgConnection,
    requests: &[StreamWrite],
) -> Result<Vec<Checkpoint>, StoreError> {
    let ids: Vec<&str> = requests.iter().map(|r| r.fence.job_id.as_str()).collect();
    let (mut row_ids, mut epochs, mut keys, mut generations, mut offsets, mut kinds, mut texts) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for r in requests {
        for row in &r.rows {
            row_ids.push(r.fence.job_id.as_str());
            epochs.push(r.fence.epoch);
            keys.push(r.key.as_str());
            generations.push(r.generation);
            offsets.push(row.offset);
            kinds.push(row.kind);
            texts.push(row.text.as_str());
        }
    }
    let written: Vec<IdRow> = sql(concat!(
        "WITH input AS (SELECT * FROM unnest($2::text[], $3::bigint[], $4::text[], $5::int[], \
             $6::int[], $7::text[], $8::text[]) WITH ORDINALITY \
             AS i(id, epoch, key, generation, \"offset\", kind, text, n)), ",
        lock_in_order!("$1"),
        ", ",
        "fenced AS ( \
             SELECT i.* FROM input i JOIN locked l ON l.id = i.id AND l.lease_epoch = i.epoch \
             WHERE (SELECT count(*) FROM locked) >= 0), \
         written AS ( \
             INSERT INTO stream_events (job_id, call_key, generation, \"offset\", kind, text) \
             SELECT id, key, generation, \"offset\", kind, text FROM fenced ORDER BY n \
             ON CONFLICT (job_id, call_key, generation, \"offset\") DO NOTHING) \
         SELECT f.id FROM (SELECT DISTINCT id FROM fenced) f \
             CROSS JOIN LATERAL (SELECT pg_notify($9, f.id)) n"
    ))
    .bind::<Array<Text>, _>(&ids)
    .bind::<Array<Text>, _>(&row_ids)
    .bind::<Array<BigInt>, _>(&epochs)
    .bind::<Array<Text>, _>(&keys)
    .bind::<Array<Integer>, _>(&generations)
    .bind::<Array<Integer>, _>(&offsets)
    .bind::<Array<Text>, _>(&kinds)
    .bind::<Array<Text>, _>(&texts)
    .bind::<Text, _>(STREAM_CHANNEL)
    .load(conn)
    .await?;
    let written: std::collections::HashSet<String> = written.into_iter().map(|r| r.id).collect();
    Ok(requests
        .iter()
        .map(|r| {
            if written.contains(&r.fence.job_id) {
                Checkpoint::Moved
            } else {
                Checkpoint::LeaseLost
            }
        })
        .collect())
}

/// What the journal holds of a model call's stream: its latest generation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journaled {
    /// The latest generation (0: nothing journaled yet).
    pub generation: i32,
    /// Its chunks' text, in order: what watchers were shown.
    pub text: String,
    /// The next offset in it.
    pub next_offset: i32,
}

/// One event of a job, as a watcher gets it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct JobEvent {
    /// The event's id: increasing within the job.
    pub id: i64,
    /// `chunk`, `reset` or `state`.
    pub kind: String,
    /// The model-call key of a chunk or reset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
    /// The generation of a chunk or reset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<i32>,
    /// A chunk's offset in its generation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<i32>,
    /// A chunk's text, a reset's reason, a state's name.
    pub text: String,
    /// When it was written.
    pub at: DateTime<Utc>,
}

/// Wakes the watchers of a job on this node when its stream moved.
#[derive(Debug, Default)]
pub(crate) struct Watchers {
    jobs: Mutex<HashMap<String, std::sync::Weak<tokio::sync::Notify>>>,
}

impl Watchers {
    fn subscribe(&self, job_id: &str) -> Arc<tokio::sync::Notify> {
        let mut jobs = self.jobs.lock().expect("lock");
        if let Some(n) = jobs.get(job_id).and_then(std::sync::Weak::upgrade) {
            return n;
        }
        jobs.retain(|_, w| w.strong_count() > 0);
        let n = Arc::new(tokio::sync::Notify::new());
        jobs.insert(job_id.to_owned(), Arc::downgrade(&n));
        n
    }

    fn wake(&self, job_id: &str) {
        let n = self
            .jobs
            .lock()
            .expect("lock")
            .get(job_id)
            .and_then(std::sync::Weak::upgrade);
        if let Some(n) = n {
            n.notify_waiters();
        }
    }
}

impl Store {
    /// Journals `rows` of `key`'s stream in `generation`, fenced by the
    /// lease and group-committed with other streams' chunks; wakes this
    /// node's watchers of the job once it is durable.
    pub async fn journal_stream(
        &self,
        fence: &Fence,
        key: &str,
        generation: i32,
        rows: Vec<StreamRow>,
    ) -> Result<Checkpoint, StoreError> {
        let write = StreamWrite {
            fence: fence.clone(),
            key: key.to_owned(),
            generation,
            rows,
        };
        let out = retrying!(self, "journal_stream", async || {
            self.batches.stream.call(write.clone()).await
        })
        .await?;
        self.watchers.wake(&fence.job_id);
        Ok(out)
    }

    /// The latest generation of `key`'s stream in `job_id`'s journal.
    pub async fn journaled_stream(&self, job_id: &str, key: &str) -> Result<Journaled, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Integer)]
            generation: i32,
            #[diesel(sql_type = Nullable<Text>)]
            text: Option<String>,
            #[diesel(sql_type = Integer)]
            next_offset: i32,
        }
        let mut conn = self.db().conn().await?;
        let rows: Vec<Row> = sql(
            "WITH g AS (SELECT max(generation) AS generation FROM stream_events \
                 WHERE job_id = $1 AND call_key = $2) \
             SELECT g.generation, \
                 string_agg(e.text, '' ORDER BY e.\"offset\") FILTER (WHERE e.kind = 'chunk') AS text, \
                 coalesce(max(e.\"offset\") + 1, 0)::int AS next_offset \
             FROM g JOIN stream_events e ON e.job_id = $1 AND e.call_key = $2 \
                 AND e.generation = g.generation \
             GROUP BY g.generation",
        )
        .bind::<Text, _>(job_id)
        .bind::<Text, _>(key)
        .load(&mut conn)
        .await?;
        Ok(rows
            .into_iter()
            .next()
            .map(|r| Journaled {
                generation: r.generation,
                text: r.text.unwrap_or_default(),
                next_offset: r.next_offset.max(0),
            })
            .unwrap_or_default())
    }

    /// `job_id`'s events after `after` (chunks, resets and state changes,
    /// by id), at most `limit`.
    pub async fn job_events(
        &self,
        job_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<JobEvent>, StoreError> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            id: i64,
            #[diesel(sql_type = Text)]
            kind: String,
            #[diesel(sql_type = Nullable<Text>)]
            call: Option<String>,
            #[diesel(sql_type = Nullable<Integer>)]
            generation: Option<i32>,
            #[diesel(sql_type = Nullable<Integer>)]
            offset: Option<i32>,
            #[diesel(sql_type = Text)]
            text: String,
            #[diesel(sql_type = Timestamptz)]
            at: DateTime<Utc>,
        }
        let mut conn = self.db().conn().await?;
        let rows: Vec<Row> = sql("(SELECT id, kind, call_key AS call, generation, \
                 CASE WHEN kind = 'chunk' THEN \"offset\" END AS \"offset\", text, at \
              FROM stream_events WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3) \
             UNION ALL \
             (SELECT id, 'state', NULL, NULL, NULL, state::text, at \
              FROM job_history WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3) \
             ORDER BY id LIMIT $3")
        .bind::<Text, _>(job_id)
        .bind::<BigInt, _>(after)
        .bind::<BigInt, _>(limit)
        .load(&mut conn)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| JobEvent {
                id: r.id,
                kind: r.kind,
                call: r.call,
                generation: r.generation,
                offset: r.offset,
                text: r.text,
                at: r.at,
            })
            .collect())
    }

    /// Resolves when `job_id`'s stream may have moved (a batch of its chunks
    /// committed, here or on another node); register before reading.
    pub fn watch_stream(&self, job_id: &str) -> Arc<tokio::sync::Notify> {
        self.watchers.subscribe(job_id)
    }

    /// A node announced that `job_id`'s stream moved ([`STREAM_CHANNEL`]).
    pub fn stream_moved(&self, job_id: &str) {
        self.watchers.wake(job_id);
    }
}
