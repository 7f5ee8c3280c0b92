ALTER TABLE signals DROP COLUMN for_wait;
