-- The acquire walks only the tenants that have live jobs, in order of pass
-- (see engine/src/store/lease.rs, `ACQUIRE`), instead of finding them with
-- a skip scan over every tenant's jobs: a tenant is `live` from its first
-- unfinished job until the sweep (`Leases::rest_idle_tenants`) finds it has
-- none.
--
-- Marked live by triggers, so every path that makes a job live (intake,
-- a child, a schedule's firing, a redrive) marks it, in the same
-- transaction. A trigger that finds its tenant live already takes only a
-- KEY SHARE lock on the row (no write; concurrent intakes do not wait on
-- each other); the sweep locks a row FOR UPDATE SKIP LOCKED before it
-- clears it, so it leaves alone every tenant an open intake saw live, then
-- reads the jobs again with a new snapshot. An intake that comes after the
-- sweep's lock waits for it, then finds the tenant not live and marks it
-- again.
ALTER TABLE tenant_turns ADD COLUMN live BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX tenant_turns_live ON tenant_turns (pass, tenant) WHERE live;

CREATE FUNCTION tenant_mark_live(t BIGINT) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM tenant_turns WHERE tenant = t AND live FOR KEY SHARE;
    IF NOT FOUND THEN
        INSERT INTO tenant_turns (tenant, pass, live) VALUES (t, 0, true)
        ON CONFLICT (tenant) DO UPDATE SET live = true WHERE NOT tenant_turns.live;
    END IF;
END $$;

CREATE FUNCTION tenants_of_new_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE t BIGINT;
BEGIN
    FOR t IN SELECT DISTINCT tenant FROM new_jobs WHERE finished_at IS NULL ORDER BY tenant LOOP
        PERFORM tenant_mark_live(t);
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_tenant_live AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION tenants_of_new_jobs();

CREATE FUNCTION tenant_of_revived_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM tenant_mark_live(NEW.tenant);
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_tenant_live_again AFTER UPDATE OF finished_at ON jobs
    FOR EACH ROW WHEN (OLD.finished_at IS NOT NULL AND NEW.finished_at IS NULL)
    EXECUTE FUNCTION tenant_of_revived_job();

-- The tenants with live jobs now, read after the triggers exist: creating
-- them locked `jobs` against writes until this transaction ends, so a job
-- another node commits meanwhile is either seen here or marks its tenant
-- itself.
INSERT INTO tenant_turns (tenant, pass, live)
    SELECT DISTINCT tenant, 0, true FROM jobs WHERE finished_at IS NULL
    ON CONFLICT (tenant) DO UPDATE SET live = true;
