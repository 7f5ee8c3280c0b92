ALTER TABLE jobs DROP COLUMN owner_token;
DROP TABLE api_tokens;
