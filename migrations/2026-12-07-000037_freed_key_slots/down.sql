DROP TRIGGER jobs_key_slot_freed ON jobs;
DROP FUNCTION onceflow_key_slot_freed();
DROP INDEX jobs_keyed_live;
