-- A child belongs to one life (incarnation) of its parent, not to the id:
-- after a parent is purged and its id submitted again (perhaps by another
-- token), the new job must see nothing of the old one's children — not in
-- its view, not in a cancel's cascade, not in a join's wake-up.
--
-- The link is (parent_id, parent_incarnation). Existing children are
-- backfilled from their own id, which names the life that made them
-- (`{parent}:child:{name}` for the first, `{parent}:child.{n}:{name}` for
-- the n-th; see engine/src/context/children.rs, `child_id`).
ALTER TABLE jobs ADD COLUMN parent_incarnation INT;

UPDATE jobs SET parent_incarnation = CASE
        WHEN left(id, length(parent_id) + 7) = parent_id || ':child:' THEN 1
        ELSE substring(substr(id, length(parent_id) + 1) FROM '^:child\.([0-9]+):')::int
    END
WHERE parent_id IS NOT NULL;

-- A finishing child wakes only a waiting parent of its own life.
CREATE OR REPLACE FUNCTION onceflow_child_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs SET run_at = now(), updated_at = now()
    WHERE id = NEW.parent_id AND incarnation = NEW.parent_incarnation
      AND finished_at IS NULL AND lease_owner IS NULL
      AND waiting->>'kind' = 'children';
    IF FOUND THEN
        PERFORM pg_notify('onceflow_new_job', NEW.parent_id);
    END IF;
    RETURN NULL;
END $$;

-- A child inserted without its parent's life (by a node of an older
-- version, during a rolling upgrade) takes it from the parent's row.
CREATE FUNCTION onceflow_child_life() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT incarnation INTO NEW.parent_incarnation FROM jobs WHERE id = NEW.parent_id;
    RETURN NEW;
END $$;

CREATE TRIGGER jobs_child_life BEFORE INSERT ON jobs
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL AND NEW.parent_incarnation IS NULL)
    EXECUTE FUNCTION onceflow_child_life();
