-- Priorities: among jobs that are due, higher first. The scheduler's index
-- orders by priority, then by due time; like before, only live jobs are in it.
ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (priority DESC, run_at) WHERE finished_at IS NULL;
