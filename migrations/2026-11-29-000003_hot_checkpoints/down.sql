ALTER TABLE outbox RESET (fillfactor);
ALTER TABLE model_calls RESET (fillfactor);
ALTER TABLE jobs RESET (fillfactor);
DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (run_at) WHERE state NOT IN ('acked', 'dead');
