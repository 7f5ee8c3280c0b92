DROP TRIGGER jobs_tenant_live_again ON jobs;
DROP FUNCTION tenant_of_revived_job();
DROP TRIGGER jobs_tenant_live ON jobs;
DROP FUNCTION tenants_of_new_jobs();
DROP FUNCTION tenant_mark_live(BIGINT);
DROP INDEX tenant_turns_live;
ALTER TABLE tenant_turns DROP COLUMN live;
