DROP TRIGGER jobs_child_life ON jobs;
DROP FUNCTION onceflow_child_life();
CREATE OR REPLACE FUNCTION onceflow_child_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs SET run_at = now(), updated_at = now()
    WHERE id = NEW.parent_id AND finished_at IS NULL AND lease_owner IS NULL
      AND waiting->>'kind' = 'children';
    IF FOUND THEN
        PERFORM pg_notify('onceflow_new_job', NEW.parent_id);
    END IF;
    RETURN NULL;
END $$;
ALTER TABLE jobs DROP COLUMN parent_incarnation;
