-- A token's own Standard Webhooks signing secret(s): its jobs' webhooks are
-- signed with them, so one tenant cannot have onceflow sign a webhook that
-- another tenant's consumer accepts. Several, space-separated, while
-- rotating (newest first). NULL for admin tokens and tokens made before this
-- column: their jobs are signed with the node's ONCEFLOW_WEBHOOK_SECRET.
ALTER TABLE api_tokens ADD COLUMN webhook_secret TEXT
    CHECK (webhook_secret ~ '^whsec_[A-Za-z0-9+/]+=*( whsec_[A-Za-z0-9+/]+=*)?$');
