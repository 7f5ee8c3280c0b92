DROP TABLE signals;
DROP TABLE waits;
DROP INDEX jobs_waiting;
ALTER TABLE jobs DROP COLUMN waiting;
