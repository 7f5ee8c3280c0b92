-- How many times each general step (`ctx.step`) of a job failed with a
-- retryable error: its retry budget. Counted per step, not per job attempt,
-- so a job that waited or retried elsewhere keeps each step's full budget;
-- a redrive clears it (a fresh budget, the same keys).
CREATE TABLE step_failures (
    job_id         TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step_key       TEXT NOT NULL,
    failures       INT NOT NULL CHECK (failures > 0),
    last_failed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step_key)
);
