ALTER TABLE jobs SET (fillfactor = 70);
ALTER TABLE model_calls SET (fillfactor = 80);
ALTER TABLE outbox SET (fillfactor = 80);
DROP INDEX outbox_events_due;
CREATE INDEX outbox_events_due ON outbox (run_at)
    WHERE status = 'claimed' AND event <> 'job.completed';
ALTER TABLE job_history DROP CONSTRAINT job_history_pkey;
ALTER TABLE job_history ADD PRIMARY KEY (id);
CREATE INDEX job_history_job ON job_history (job_id, id);
