-- Durable waits: a job waiting for a timer or a signal holds no lease; the
-- wait is journaled (its key, kind, name and due time, then its outcome)
-- and the job row says what it waits for, so listings and the view show it.
ALTER TABLE jobs ADD COLUMN waiting JSONB;
CREATE INDEX jobs_waiting ON jobs (created_at DESC, id DESC) WHERE waiting IS NOT NULL;

CREATE TABLE waits (
    job_id     TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    wait_key   TEXT NOT NULL,
    kind       TEXT NOT NULL CHECK (kind IN ('sleep', 'signal', 'approval', 'children')),
    name       TEXT NOT NULL,
    until      TIMESTAMPTZ NOT NULL,
    outcome    JSONB,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    done_at    TIMESTAMPTZ,
    PRIMARY KEY (job_id, wait_key),
    CONSTRAINT done_shape CHECK ((outcome IS NULL) = (done_at IS NULL))
);

-- Signals sent to a job: each recorded once (its id is its key), kept until
-- the job ends, taken oldest first by the waits of its name.
CREATE TABLE signals (
    job_id       TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    signal_id    TEXT NOT NULL,
    payload      JSONB NOT NULL,
    payload_hash TEXT NOT NULL,
    seq          BIGSERIAL,
    received_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    taken_by     TEXT,
    PRIMARY KEY (job_id, name, signal_id)
);
CREATE INDEX signals_untaken ON signals (job_id, name, seq) WHERE taken_by IS NULL;
