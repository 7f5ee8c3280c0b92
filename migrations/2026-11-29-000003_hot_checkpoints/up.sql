-- Checkpoints between received and acked change only `state` and
-- `updated_at`. With the runnable index keyed on `finished_at IS NULL`
-- (equivalent to "not acked or dead" by the finished_shape constraint)
-- instead of on `state`, those updates touch no indexed column and can be
-- HOT updates: no new index entries per checkpoint, no index bloat for the
-- scheduler to scan. Free space per page lets the new row version stay on
-- its page.
DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (run_at) WHERE finished_at IS NULL;
ALTER TABLE jobs SET (fillfactor = 70);
ALTER TABLE model_calls SET (fillfactor = 80);
ALTER TABLE outbox SET (fillfactor = 80);
