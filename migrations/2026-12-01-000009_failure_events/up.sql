-- Failure is an event too: a job that ends dead or cancelled may send a
-- job.dead / job.cancelled webhook, through the same outbox, under its own
-- stable key. Whether it does is decided at intake (the workflow, or the
-- node's ONCEFLOW_FAILURE_EVENTS) and kept with the job.
ALTER TABLE jobs ADD COLUMN notify_failures BOOLEAN NOT NULL DEFAULT false;
-- When an event send is due again (backoff after a failed send).
ALTER TABLE outbox ADD COLUMN run_at TIMESTAMPTZ NOT NULL DEFAULT now();
CREATE INDEX outbox_events_due ON outbox (run_at)
    WHERE status = 'claimed' AND event <> 'job.completed';
