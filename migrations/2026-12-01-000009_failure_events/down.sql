DROP INDEX outbox_events_due;
ALTER TABLE outbox DROP COLUMN run_at;
ALTER TABLE jobs DROP COLUMN notify_failures;
