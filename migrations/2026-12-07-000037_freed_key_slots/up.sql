-- A key's slot that frees wakes the nodes. A job of a concurrency key
-- holds its slot (`key_slot`) while it holds its lease; every statement
-- that lets the lease go clears the slot. Without a word, the next job of
-- the key waited for some node's regular poll: a limit-1 key ran about
-- one job per poll interval. Now the statement that clears a slot
-- announces it on `onceflow_new_job` when a job of the same key waits
-- (one NOTIFY per transaction and payload: PostgreSQL folds repeats).
CREATE INDEX jobs_keyed_live ON jobs (tenant, concurrency_key)
    WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL;

CREATE FUNCTION onceflow_key_slot_freed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM jobs
               WHERE tenant = NEW.tenant AND concurrency_key = NEW.concurrency_key
                 AND finished_at IS NULL AND key_slot IS NULL AND id <> NEW.id) THEN
        PERFORM pg_notify('onceflow_new_job', 'key');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_key_slot_freed AFTER UPDATE OF key_slot ON jobs
    FOR EACH ROW
    WHEN (OLD.key_slot IS NOT NULL AND NEW.key_slot IS NULL)
    EXECUTE FUNCTION onceflow_key_slot_freed();
