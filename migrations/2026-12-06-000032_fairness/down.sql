DROP INDEX jobs_fair;
CREATE INDEX jobs_runnable ON jobs (priority DESC, run_at) WHERE finished_at IS NULL;
DROP INDEX jobs_key_slots;
ALTER TABLE jobs DROP COLUMN key_slot;
ALTER TABLE jobs DROP COLUMN concurrency_limit;
ALTER TABLE jobs DROP COLUMN concurrency_key;
ALTER TABLE api_tokens DROP COLUMN key_concurrency;
ALTER TABLE api_tokens DROP COLUMN weight;
ALTER TABLE jobs DROP COLUMN tenant;
