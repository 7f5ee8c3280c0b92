-- Rate limits (rpm, tpm) as token buckets on the key's row (see
-- engine/src/limits.rs `Bucket`): each level is as of `refilled_at`; NULL
-- until the key's first admission under that rate (a full bucket).
ALTER TABLE provider_limits
    ADD COLUMN requests    DOUBLE PRECISION,
    ADD COLUMN tokens      DOUBLE PRECISION,
    ADD COLUMN refilled_at TIMESTAMPTZ;

-- Calls waiting for a key's limit, so the one to go next is the waiter of
-- highest priority, then the longest waiting, on whichever node it runs.
-- A waiter refreshes its row each time it asks; a crashed node's lapse.
CREATE TABLE provider_waiters (
    limit_key  TEXT NOT NULL,
    holder     TEXT NOT NULL,
    node       TEXT NOT NULL,
    priority   INTEGER NOT NULL,
    since      TIMESTAMPTZ NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (limit_key, holder)
);
