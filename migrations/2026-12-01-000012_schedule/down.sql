DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (run_at) WHERE finished_at IS NULL;
ALTER TABLE jobs DROP COLUMN priority;
