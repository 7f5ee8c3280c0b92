-- The whole job lifecycle. Invariants the database can hold, it holds:
-- enums for states, UNIQUE for every idempotency key, CHECK for state shape,
-- foreign keys from every side table to its job. See engine/LIFECYCLE.md.

-- Persisted enum values are contracts: never reorder, rename or reuse them.
CREATE TYPE job_state AS ENUM (
    'received', 'generated', 'persisted', 'claimed', 'delivered', 'acked', 'dead'
);
CREATE TYPE model_call_status AS ENUM ('pending', 'completed', 'failed');
CREATE TYPE outbox_status AS ENUM ('claimed', 'delivered', 'unknown', 'dead');
CREATE TYPE tool_call_status AS ENUM ('started', 'completed', 'failed');

CREATE TABLE jobs (
    id               TEXT PRIMARY KEY
                     CHECK (id ~ '^[A-Za-z0-9_.:-]{1,200}$'),
    workflow         TEXT NOT NULL CHECK (length(workflow) BETWEEN 1 AND 100),
    request          JSONB NOT NULL,
    request_hash     TEXT NOT NULL CHECK (request_hash ~ '^[0-9a-f]{64}$'),
    state            job_state NOT NULL DEFAULT 'received',
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    lease_owner      TEXT,
    lease_epoch      BIGINT NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0),
    lease_expires_at TIMESTAMPTZ,
    run_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error       JSONB,
    dead_reason      TEXT,
    trace_context    TEXT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at      TIMESTAMPTZ,
    -- a lease is an owner and an expiry together, or neither
    CONSTRAINT lease_shape CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL)),
    -- only dead jobs carry a dead reason, and every dead job has one
    CONSTRAINT dead_shape CHECK ((state = 'dead') = (dead_reason IS NOT NULL)),
    -- finished (acked or dead) exactly when finished_at is set, and finished jobs hold no lease
    CONSTRAINT finished_shape CHECK ((state IN ('acked', 'dead')) = (finished_at IS NOT NULL)),
    CONSTRAINT finished_unleased CHECK (state NOT IN ('acked', 'dead') OR lease_owner IS NULL)
);

-- The runnable set: what the scheduler scans with FOR UPDATE SKIP LOCKED.
CREATE INDEX jobs_runnable ON jobs (run_at) WHERE state NOT IN ('acked', 'dead');
-- Leases held by a node (batched heartbeat) and retention purge.
CREATE INDEX jobs_lease_owner ON jobs (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE finished_at IS NOT NULL;

-- Append-only: one row per transition.
CREATE TABLE job_history (
    id      BIGSERIAL PRIMARY KEY,
    job_id  TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    state   job_state NOT NULL,
    attempt INTEGER NOT NULL CHECK (attempt >= 0),
    worker  TEXT NOT NULL,
    at      TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX job_history_job ON job_history (job_id, id);

CREATE FUNCTION job_history_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'job_history is append-only';
END $$;
CREATE TRIGGER job_history_no_update BEFORE UPDATE ON job_history
    FOR EACH ROW EXECUTE FUNCTION job_history_append_only();

-- One result per job: a retry loads it, never regenerates.
CREATE TABLE results (
    job_id     TEXT PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    output     JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The model-call journal, one row per idempotency key.
CREATE TABLE model_calls (
    id              BIGSERIAL PRIMARY KEY,
    job_id          TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    idempotency_key TEXT NOT NULL UNIQUE,
    request_hash    TEXT NOT NULL CHECK (request_hash ~ '^[0-9a-f]{64}$'),
    status          model_call_status NOT NULL DEFAULT 'pending',
    response        JSONB,
    input_tokens    INTEGER CHECK (input_tokens >= 0),
    output_tokens   INTEGER CHECK (output_tokens >= 0),
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_status     INTEGER,
    -- set while one attempt has the request in flight; a concurrent attempt
    -- with the same lease epoch waits instead of calling the model too. A later
    -- epoch (a takeover) does not wait: it resends under the same key.
    in_flight_until TIMESTAMPTZ,
    in_flight_epoch BIGINT,
    last_error      JSONB,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT completed_shape CHECK ((status = 'completed') = (response IS NOT NULL))
);
CREATE INDEX model_calls_job ON model_calls (job_id);

-- The webhook outbox. The key is the event's identity, stable across attempts.
CREATE TABLE outbox (
    id              BIGSERIAL PRIMARY KEY,
    job_id          TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    event           TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    url             TEXT NOT NULL,
    body            JSONB NOT NULL,
    status          outbox_status NOT NULL DEFAULT 'claimed',
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      JSONB,
    last_status     INTEGER,
    -- set while one attempt has the POST in flight (see model_calls.in_flight_until)
    in_flight_until TIMESTAMPTZ,
    in_flight_epoch BIGINT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    delivered_at    TIMESTAMPTZ,
    UNIQUE (job_id, event),
    CONSTRAINT delivered_shape CHECK ((status = 'delivered') = (delivered_at IS NOT NULL))
);

-- The tool ledger: a tool call runs once per (job, provider tool-call id, position).
CREATE TABLE tool_calls (
    id             BIGSERIAL PRIMARY KEY,
    job_id         TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    tool_call_id   TEXT NOT NULL,
    turn           INTEGER NOT NULL CHECK (turn >= 0),
    call_index     INTEGER NOT NULL CHECK (call_index >= 0),
    tool_name      TEXT NOT NULL,
    arguments_hash TEXT NOT NULL CHECK (arguments_hash ~ '^[0-9a-f]{64}$'),
    status         tool_call_status NOT NULL DEFAULT 'started',
    -- stored as TEXT, not JSONB: a replay must return the result byte for byte
    result         TEXT,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at   TIMESTAMPTZ,
    UNIQUE (job_id, tool_call_id, turn, call_index),
    UNIQUE (job_id, turn, call_index),
    CONSTRAINT completed_shape CHECK ((status = 'completed') = (result IS NOT NULL AND completed_at IS NOT NULL))
);

-- The general step journal (ctx.step): one committed outcome per step key.
CREATE TABLE steps (
    job_id     TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step_key   TEXT NOT NULL,
    output     TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step_key)
);
