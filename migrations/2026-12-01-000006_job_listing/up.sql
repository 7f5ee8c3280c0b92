-- The job list: newest first, paginated by (created_at, id) keyset. Neither
-- column changes after intake, so checkpoints stay HOT updates.
CREATE INDEX jobs_newest ON jobs (created_at DESC, id DESC);
