ALTER TABLE jobs DROP COLUMN store_failures;
