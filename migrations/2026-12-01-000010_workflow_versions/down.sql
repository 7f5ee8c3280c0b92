ALTER TABLE jobs DROP COLUMN workflow_version;
