-- Fairness between tenants (see engine/src/store/lease.rs, `acquire`).
--
-- A job's tenant: the token that submitted it, unless that is an admin
-- token; 0 stands for admin tokens and development mode together (one
-- more tenant). Fixed at intake, so the acquire needs no join to find it.
ALTER TABLE jobs ADD COLUMN tenant BIGINT NOT NULL DEFAULT 0;
UPDATE jobs j SET tenant = j.owner_token
    FROM api_tokens t WHERE t.id = j.owner_token AND NOT t.admin;

-- A token's share of the nodes' turns when several tenants wait (1 to
-- 1000), and the most jobs of one concurrency key of its that run at once
-- (NULL: the workflow's limit, or 1).
ALTER TABLE api_tokens ADD COLUMN weight INTEGER NOT NULL DEFAULT 1
    CHECK (weight BETWEEN 1 AND 1000);
ALTER TABLE api_tokens ADD COLUMN key_concurrency INTEGER
    CHECK (key_concurrency BETWEEN 1 AND 1000);

-- Per-key concurrency. A job with a key runs only in one of its key's
-- `concurrency_limit` slots; the slot is `key_slot`, held while the job
-- holds its lease: every statement that lets a lease go (a finish, a wait,
-- a cancel, a release) clears it, and a crashed job keeps it until its own
-- takeover. The unique index decides a race between two nodes for the
-- last slot: the loser's acquire fails and is run again. Its predicate
-- names `key_slot` alone, which a job without a key never changes, so a
-- lease change stays a HOT update. Keys cost nothing when idle: no rows.
ALTER TABLE jobs ADD COLUMN concurrency_key TEXT
    CHECK (length(concurrency_key) BETWEEN 1 AND 200);
ALTER TABLE jobs ADD COLUMN concurrency_limit INTEGER
    CHECK (concurrency_limit BETWEEN 1 AND 1000);
ALTER TABLE jobs ADD COLUMN key_slot INTEGER;
CREATE UNIQUE INDEX jobs_key_slots ON jobs (tenant, concurrency_key, key_slot)
    WHERE key_slot IS NOT NULL;

-- Each tenant's place in the turns (start-time fair queueing): its pass
-- is the virtual time after its last start; a start costs 1 / weight.
-- Written only by the acquire, for the tenants it took jobs from. One row
-- per tenant that ever started a job.
CREATE TABLE tenant_turns (
    tenant BIGINT PRIMARY KEY,
    pass   DOUBLE PRECISION NOT NULL
);

-- The acquire walks the tenants with live jobs (a skip scan over the
-- leading column) and takes each one's head in its own priority order.
DROP INDEX jobs_runnable;
CREATE INDEX jobs_fair ON jobs (tenant, priority DESC, run_at) WHERE finished_at IS NULL;
