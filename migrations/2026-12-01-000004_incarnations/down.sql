DROP TABLE job_tombstones;
ALTER TABLE jobs DROP COLUMN incarnation;
