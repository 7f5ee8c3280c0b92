ALTER TABLE job_history DROP COLUMN note;
ALTER TABLE jobs DROP CONSTRAINT finished_unleased;
ALTER TABLE jobs ADD CONSTRAINT finished_unleased CHECK (state NOT IN ('acked', 'dead') OR lease_owner IS NULL);
ALTER TABLE jobs DROP CONSTRAINT finished_shape;
ALTER TABLE jobs ADD CONSTRAINT finished_shape CHECK ((state IN ('acked', 'dead')) = (finished_at IS NOT NULL));
