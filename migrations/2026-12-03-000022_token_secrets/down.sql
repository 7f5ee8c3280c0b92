ALTER TABLE api_tokens DROP COLUMN webhook_secret;
