CREATE INDEX jobs_lease_owner ON jobs (lease_owner) WHERE lease_owner IS NOT NULL;
