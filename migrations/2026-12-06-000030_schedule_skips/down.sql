ALTER TABLE schedule_fires DROP COLUMN skipped;
