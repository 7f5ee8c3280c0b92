-- Provider limits shared by every node on this database. A limit key is
-- `provider/model`. `window` is the learned number of concurrent calls the
-- provider accepts (see engine/src/limits.rs: additive increase while the
-- calls fill it, halved on a 429); NULL until the first 429. Its row is also
-- the lock that serialises admissions and releases for the key.
CREATE TABLE provider_limits (
    limit_key    TEXT PRIMARY KEY,
    "window"     DOUBLE PRECISION CHECK ("window" IS NULL OR "window" >= 1),
    decreased_at TIMESTAMPTZ,
    throttled    BIGINT NOT NULL DEFAULT 0
);
-- One row per call holding a slot; a crashed node's slots lapse at expires_at.
CREATE TABLE provider_slots (
    limit_key  TEXT NOT NULL,
    holder     TEXT NOT NULL,
    node       TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (limit_key, holder)
);
