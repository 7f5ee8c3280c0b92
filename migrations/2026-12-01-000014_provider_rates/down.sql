DROP TABLE provider_waiters;
ALTER TABLE provider_limits DROP COLUMN requests, DROP COLUMN tokens, DROP COLUMN refilled_at;
