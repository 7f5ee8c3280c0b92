-- API tokens: stored as the SHA-256 of the token (shown once, at creation).
-- A job belongs to the token that submitted it; an admin token sees all.
CREATE TABLE api_tokens (
    id         BIGSERIAL PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9_.:-]{1,100}$'),
    token_hash TEXT NOT NULL UNIQUE CHECK (token_hash ~ '^[0-9a-f]{64}$'),
    admin      BOOLEAN NOT NULL DEFAULT false,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at TIMESTAMPTZ
);
-- Which token submitted the job (NULL: submitted without authentication, in
-- loopback development mode). No foreign key: a revoked token's row stays,
-- and intake pays no key-share lock for it.
ALTER TABLE jobs ADD COLUMN owner_token BIGINT;
