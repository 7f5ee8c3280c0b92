-- Child jobs: a job started by another job's workflow (`ctx.spawn`) names
-- its parent. A parent waiting for its children (`ctx.join`) holds no
-- lease; when a child finishes (acked, dead or cancelled, by any path),
-- this trigger makes its waiting parent due at once and wakes the nodes.
-- A join share-locks the children's rows while it decides: a child that
-- finishes meanwhile waits for the join's commit (which released the
-- parent), so this update then finds the parent waiting.
ALTER TABLE jobs ADD COLUMN parent_id TEXT;
CREATE INDEX jobs_parent ON jobs (parent_id) WHERE parent_id IS NOT NULL;

CREATE FUNCTION onceflow_child_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs SET run_at = now(), updated_at = now()
    WHERE id = NEW.parent_id AND finished_at IS NULL AND lease_owner IS NULL
      AND waiting->>'kind' = 'children';
    IF FOUND THEN
        PERFORM pg_notify('onceflow_new_job', NEW.parent_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_child_finished AFTER UPDATE OF finished_at ON jobs
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL AND OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL)
    EXECUTE FUNCTION onceflow_child_finished();
