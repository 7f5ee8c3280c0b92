ALTER TABLE api_tokens DROP COLUMN released_at;
