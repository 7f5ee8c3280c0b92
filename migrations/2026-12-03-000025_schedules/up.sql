-- Schedules: a cron that creates jobs. Each fire time is recorded once
-- (schedule_fires' primary key) in the same commit as its job, whose id is
-- `{schedule id}:{fire time, UTC, YYYYMMDDTHHMMSSZ}`; the schedule's row is
-- locked while it fires, so a delete or pause either waits for the firing
-- or stops it.
CREATE TABLE schedules (
    id            TEXT PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9_.-]{1,150}$'),
    owner_token   BIGINT,
    cron          TEXT NOT NULL,
    timezone      TEXT NOT NULL,
    workflow      TEXT NOT NULL,
    input         JSONB NOT NULL,
    webhook_url   TEXT NOT NULL,
    catch_up      TEXT NOT NULL CHECK (catch_up IN ('latest', 'all', 'none')),
    body_hash     TEXT NOT NULL,
    paused        BOOLEAN NOT NULL DEFAULT false,
    next_fire_at  TIMESTAMPTZ NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE NOT paused;

CREATE TABLE schedule_fires (
    schedule_id TEXT NOT NULL REFERENCES schedules (id) ON DELETE CASCADE,
    fire_at     TIMESTAMPTZ NOT NULL,
    job_id      TEXT NOT NULL,
    fired_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (schedule_id, fire_at)
);
