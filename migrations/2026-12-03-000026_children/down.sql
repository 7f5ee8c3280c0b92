DROP TRIGGER jobs_child_finished ON jobs;
DROP FUNCTION onceflow_child_finished();
DROP INDEX jobs_parent;
ALTER TABLE jobs DROP COLUMN parent_id;
