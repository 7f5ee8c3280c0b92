-- Once a token has existed, the API requires one (a revoked last token does
-- not reopen development mode) until the operator releases the revoked
-- tokens explicitly (`onceflow token open-development-mode`).
ALTER TABLE api_tokens ADD COLUMN released_at TIMESTAMPTZ;
ALTER TABLE api_tokens ADD CONSTRAINT released_only_when_revoked
    CHECK (released_at IS NULL OR revoked_at IS NOT NULL);
