-- A job id can be submitted again once its job was purged (retention). Each
-- life of an id is an incarnation: the first keeps the keys consumers already
-- know (`job:{id}:…`), a later one gets its own (`job:{id}#{n}:…`), so a
-- consumer that de-duplicates by webhook-id never drops it. Lease epochs
-- continue across incarnations, so a zombie of an old one can never match a
-- new one's fence.
ALTER TABLE jobs ADD COLUMN incarnation INTEGER NOT NULL DEFAULT 1 CHECK (incarnation >= 1);

-- What outlives a purge: one small row per purged id.
CREATE TABLE job_tombstones (
    id          TEXT PRIMARY KEY,
    incarnation INTEGER NOT NULL CHECK (incarnation >= 1),
    last_epoch  BIGINT NOT NULL CHECK (last_epoch >= 0),
    purged_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
