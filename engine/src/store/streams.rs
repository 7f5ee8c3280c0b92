//! The stream journal (`stream_events`): the chunks of streamed model
//! answers, group-committed and fenced like every other write, and the
//! events a watcher of a job reads (`GET /v1/jobs/{id}/events`): its chunks,
//! resets and state changes in one increasing sequence of ids.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::group_commit::ForJob;
use super::rows::lock_in_order;
use super::sql::sql;
use super::{Checkpoint, Fence};
use super::{Events, Journal};
use crate::error::StoreError;

/// The channel a committed batch of chunks is announced on (the job id as
/// payload), so watchers on other nodes read it at once.
pub const STREAM_CHANNEL: &str = super::rows::Channel::Stream.name();

/// One row of a stream's journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRow {
    /// The offset in its generation (`-1` for a reset).
    pub offset: i32,
    /// `chunk`, `reset` or `tool`.
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

/// A stream write's outcome: the rows as committed (with their ids and the
/// job's event before them), or why nothing was written.
pub(crate) type Written = (Checkpoint, Published);

/// Writes the chunks of many streams in one statement, each job's rows only
/// while its lease epoch holds (the job rows locked in id order first, as
/// every batch does), announces each job on [`STREAM_CHANNEL`], and returns
/// the rows written, with their ids.
pub(crate) async fn stream_on(
    conn: &mut AsyncPgConnection,
    requests: &[StreamWrite],
) -> Result<Vec<Written>, StoreError> {
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
    let rows: Vec<WrittenRow> = sql(WRITE_STREAMS)
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
    let by_job = published_by_job(rows);
    Ok(requests
        .iter()
        .map(|r| match by_job.get(&r.fence.job_id) {
            Some(published) => (Checkpoint::Moved, published.clone()),
            None => (
                Checkpoint::LeaseLost,
                Published {
                    prev: None,
                    upto: None,
                    events: Vec::new(),
                },
            ),
        })
        .collect())
}

/// A row of [`stream_on`]'s answer: a job with its previous event, and
/// one row written for it (none when its write wrote nothing new).
#[derive(QueryableByName)]
struct WrittenRow {
    #[diesel(sql_type = Text)]
    job_id: String,
    /// The job's last event before this write (read under its row lock,
    /// which every writer of its events holds: exact).
    #[diesel(sql_type = Nullable<BigInt>)]
    prev: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    id: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    call: Option<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    generation: Option<i32>,
    #[diesel(sql_type = Nullable<Integer>)]
    offset: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    kind: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    text: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    at: Option<DateTime<Utc>>,
}

/// The statement behind [`stream_on`].
const WRITE_STREAMS: &str = concat!(
    "WITH input AS (SELECT * FROM unnest( \
             (SELECT $2::text[]), (SELECT $3::bigint[]), (SELECT $4::text[]), \
             (SELECT $5::int[]), (SELECT $6::int[]), (SELECT $7::text[]), \
             (SELECT $8::text[])) WITH ORDINALITY \
         AS i(id, epoch, key, generation, \"offset\", kind, text, n)), ",
    lock_in_order!("$1"),
    ", ",
    "fenced AS ( \
         SELECT i.* FROM input i JOIN locked l ON l.id = i.id AND l.lease_epoch = i.epoch \
         WHERE (SELECT count(*) FROM locked) >= 0), \
     written AS ( \
         INSERT INTO stream_events (job_id, call_key, generation, \"offset\", kind, text) \
         SELECT id, key, generation, \"offset\", kind, text FROM fenced ORDER BY n \
         ON CONFLICT (job_id, call_key, generation, \"offset\") DO NOTHING \
         RETURNING id, job_id, call_key, generation, \"offset\", kind, text, at), \
     jobs AS (SELECT DISTINCT id FROM fenced), \
     notified AS (SELECT count(pg_notify($9, w.job_id || ' ' || w.last)) AS n \
         FROM (SELECT job_id, max(id) AS last FROM written GROUP BY job_id) w), \
     prev AS (SELECT j.id, greatest( \
             (SELECT max(h.id) FROM job_history h WHERE h.job_id = j.id), \
             (SELECT max(e.id) FROM stream_events e WHERE e.job_id = j.id)) AS prev \
         FROM jobs j) \
     SELECT j.id AS job_id, p.prev, w.id, w.call_key AS call, w.generation, w.\"offset\", \
         w.kind, w.text, w.at \
     FROM jobs j CROSS JOIN notified JOIN prev p ON p.id = j.id \
         LEFT JOIN written w ON w.job_id = j.id \
     ORDER BY w.id"
);

/// Groups the rows written by job, each with the event before them.
fn published_by_job(rows: Vec<WrittenRow>) -> HashMap<String, Published> {
    let mut by_job: HashMap<String, Published> = HashMap::new();
    for r in rows {
        let published = by_job.entry(r.job_id).or_insert_with(|| Published {
            prev: r.prev,
            upto: None,
            events: Vec::new(),
        });
        let events = &mut published.events;
        if let (Some(id), Some(kind), Some(text), Some(at)) = (r.id, r.kind, r.text, r.at) {
            events.push(JobEvent::new(
                id,
                kind,
                r.call,
                r.generation,
                r.offset,
                text,
                at,
            ));
        }
    }
    by_job
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
    /// `chunk`, `reset`, `tool` or `state`.
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
    /// A chunk's text, a reset's reason, a state's name, a tool event's
    /// phase (`started`, `finished`, `failed`, `replayed`).
    pub text: String,
    /// A tool event's call: `{"phase", "name", "tool_call_id"}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<serde_json::Value>,
    /// When it was written.
    pub at: DateTime<Utc>,
}

impl JobEvent {
    /// An event from its journal row: a chunk keeps its offset; a tool
    /// row's JSON text becomes `tool`, and its phase the `text`.
    fn new(
        id: i64,
        kind: String,
        call: Option<String>,
        generation: Option<i32>,
        offset: Option<i32>,
        text: String,
        at: DateTime<Utc>,
    ) -> Self {
        let (text, tool) = if kind == "tool" {
            let tool: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            let phase = tool["phase"].as_str().unwrap_or_default().to_owned();
            (phase, Some(tool))
        } else {
            (text, None)
        };
        JobEvent {
            id,
            offset: offset.filter(|_| kind == "chunk"),
            generation: generation.filter(|_| kind != "tool"),
            kind,
            call,
            text,
            tool,
            at,
        }
    }
}

/// Committed events of one job, handed to this node's watchers so they
/// need not read them back: `prev` is the id of the job's event just before
/// them (`None`: only an announcement from another node), so a watcher
/// uses them only when it has seen exactly up to `prev`, and reads the
/// journal otherwise.
#[derive(Debug, Clone)]
pub struct Published {
    /// The id of the job's event before them (`None`: an announcement).
    pub prev: Option<i64>,
    /// An announcement from a node (maybe this one): the job's events now
    /// reach this id.
    pub upto: Option<i64>,
    /// The events, as committed, by id.
    pub events: Vec<JobEvent>,
}

/// The channel a token's revocation or secret rotation is announced on
/// (payload: its id), so its streams on every node end at once and its new
/// secret signs at once.
pub const TOKENS_CHANNEL: &str = super::rows::Channel::Tokens.name();

impl Journal<'_> {
    /// Journals `rows` of `key`'s stream in `generation`, fenced by the
    /// lease and group-committed with other streams' chunks; returns the
    /// committed rows, with the id of the job's event before them, for this
    /// node's watchers ([`crate::hub::Hub::publish`]).
    pub async fn stream(
        self,
        fence: &Fence,
        key: &str,
        generation: i32,
        rows: Vec<StreamRow>,
    ) -> Result<(Checkpoint, Published), StoreError> {
        let write = StreamWrite {
            fence: fence.clone(),
            key: key.to_owned(),
            generation,
            rows,
        };
        (self.batches.stream)
            .call_retrying(&self, "journal_stream", write)
            .await
    }

    /// The latest generation of `key`'s stream in `job_id`'s journal.
    pub async fn streamed(self, job_id: &str, key: &str) -> Result<Journaled, StoreError> {
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
}

impl Events<'_> {
    /// `job_id`'s events after `after` (chunks, resets and state changes,
    /// by id), at most `limit`.
    pub async fn of_job(
        self,
        job_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<JobEvent>, StoreError> {
        self.event_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
            .map(|r| JobEvent::new(r.id, r.kind, r.call, r.generation, r.offset, r.text, r.at))
            .collect())
    }

    /// Records that a stream follows `job_id`: every transition of the job
    /// then `NOTIFY`s [`STREAM_CHANNEL`] (a trigger on `job_history`), so
    /// its watchers on any node read the journal only when it moved.
    /// Returns the row to remove with [`Self::unfollow`].
    pub async fn follow(self, job_id: &str) -> Result<i64, StoreError> {
        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut conn = self.db().conn().await?;
        let row: Id = sql("INSERT INTO stream_watchers (job_id) VALUES ($1) RETURNING id")
            .bind::<Text, _>(job_id)
            .get_result(&mut conn)
            .await?;
        Ok(row.id)
    }

    /// The stream `id` ended.
    pub async fn unfollow(self, id: i64) -> Result<(), StoreError> {
        let mut conn = self.db().conn().await?;
        sql("DELETE FROM stream_watchers WHERE id = $1")
            .bind::<BigInt, _>(id)
            .execute(&mut conn)
            .await?;
        Ok(())
    }
}
