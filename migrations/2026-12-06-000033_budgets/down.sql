DROP TABLE token_spend;
ALTER TABLE api_tokens DROP COLUMN budget_exhausted;
ALTER TABLE api_tokens DROP COLUMN daily_token_budget;
