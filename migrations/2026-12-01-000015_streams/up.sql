-- The journal of streamed model answers (`"stream": true`): every chunk as
-- it arrived, keyed by (job, model-call key, generation, offset). A stream
-- restarted with a different answer starts a new generation, announced by a
-- `reset` row (offset -1) that says why, so the journal keeps every
-- generation honestly. Ids come from job_history's sequence: a job's chunks,
-- resets and state changes share one increasing sequence, which is the
-- `id` of `GET /v1/jobs/{id}/events` (a job's rows are written one commit
-- after another by the one attempt holding its lease, fenced by its epoch).
CREATE TABLE stream_events (
    id         BIGINT PRIMARY KEY DEFAULT nextval('job_history_id_seq'),
    job_id     TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    call_key   TEXT NOT NULL,
    generation INTEGER NOT NULL CHECK (generation >= 1),
    "offset"   INTEGER NOT NULL CHECK ("offset" >= -1),
    kind       TEXT NOT NULL CHECK (kind IN ('chunk', 'reset')),
    text       TEXT NOT NULL,
    at         TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (job_id, call_key, generation, "offset"),
    CHECK ((kind = 'reset') = ("offset" = -1))
);
CREATE INDEX stream_events_job ON stream_events (job_id, id);
