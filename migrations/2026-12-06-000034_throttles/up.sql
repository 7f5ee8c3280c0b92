-- Per-key throttles (see engine/src/store/lease.rs, `ACQUIRE`).
--
-- A token's throttle per concurrency key: at most `key_throttle` jobs of
-- one key start in any `key_throttle_period_s` seconds (both or neither).
ALTER TABLE api_tokens ADD COLUMN key_throttle INTEGER
    CHECK (key_throttle BETWEEN 1 AND 1000);
ALTER TABLE api_tokens ADD COLUMN key_throttle_period_s INTEGER
    CHECK (key_throttle_period_s BETWEEN 1 AND 86400);
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_key_throttle_whole
    CHECK ((key_throttle IS NULL) = (key_throttle_period_s IS NULL));

-- A keyed job's throttle, fixed at intake (the workflow's or its token's;
-- with both, the fewer starts over the longer period), and its place in it
-- once it started: a key has `throttle_limit` start slots, and slot s is free again `throttle_period_s`
-- after its latest start (`throttle_at`). Each start of a slot takes the
-- next generation, so the unique index decides a race between two nodes
-- for one slot (the later acquire fails and is run again). A job keeps its
-- stamp for life: its retries and takeovers are not new starts. Keys cost
-- nothing when idle: the stamps are columns of the jobs that started.
ALTER TABLE jobs ADD COLUMN throttle_limit INTEGER
    CHECK (throttle_limit BETWEEN 1 AND 1000);
ALTER TABLE jobs ADD COLUMN throttle_period_s INTEGER
    CHECK (throttle_period_s BETWEEN 1 AND 86400);
ALTER TABLE jobs ADD COLUMN throttle_slot INTEGER;
ALTER TABLE jobs ADD COLUMN throttle_gen INTEGER;
ALTER TABLE jobs ADD COLUMN throttle_at TIMESTAMPTZ;
CREATE UNIQUE INDEX jobs_throttle_slots
    ON jobs (tenant, concurrency_key, throttle_slot, throttle_gen)
    WHERE throttle_slot IS NOT NULL;

-- The start slots of a key that are free now, each with the generation
-- its next start takes, lowest slot first; one index probe per slot.
CREATE FUNCTION throttle_free_slots(p_tenant BIGINT, p_key TEXT, p_limit INTEGER, p_period_s INTEGER)
RETURNS TABLE (slot INTEGER, gen INTEGER, free_at TIMESTAMPTZ)
LANGUAGE sql STABLE AS $$
    SELECT s, coalesce(last.gen, 0) + 1, last.at + make_interval(secs => p_period_s)
    FROM generate_series(0, p_limit - 1) s
    LEFT JOIN LATERAL (
        SELECT k.throttle_gen AS gen, k.throttle_at AS at FROM jobs k
        WHERE k.tenant = p_tenant AND k.concurrency_key = p_key AND k.throttle_slot = s
        ORDER BY k.throttle_gen DESC LIMIT 1) last ON true
    WHERE last.at IS NULL OR last.at <= now() - make_interval(secs => p_period_s)
    ORDER BY s
$$;

-- When the first start slot of a key frees (for a job that waits for one).
CREATE FUNCTION throttle_next_free(p_tenant BIGINT, p_key TEXT, p_limit INTEGER, p_period_s INTEGER)
RETURNS TIMESTAMPTZ
LANGUAGE sql STABLE AS $$
    SELECT min(last.at) + make_interval(secs => p_period_s)
    FROM generate_series(0, p_limit - 1) s
    CROSS JOIN LATERAL (
        SELECT k.throttle_at AS at FROM jobs k
        WHERE k.tenant = p_tenant AND k.concurrency_key = p_key AND k.throttle_slot = s
        ORDER BY k.throttle_gen DESC LIMIT 1) last
$$;
