-- Cancelled jobs are finished like acked and dead ones.
ALTER TABLE jobs DROP CONSTRAINT finished_shape;
ALTER TABLE jobs ADD CONSTRAINT finished_shape
    CHECK ((state IN ('acked', 'dead', 'cancelled')) = (finished_at IS NOT NULL));
ALTER TABLE jobs DROP CONSTRAINT finished_unleased;
ALTER TABLE jobs ADD CONSTRAINT finished_unleased
    CHECK (state NOT IN ('acked', 'dead', 'cancelled') OR lease_owner IS NULL);
-- Who asked and why, for the transitions an operator makes (redrive, cancel).
ALTER TABLE job_history ADD COLUMN note TEXT;
