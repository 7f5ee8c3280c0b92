-- Model-token budgets per token (see engine/src/store/budgets.rs).
--
-- A token's budget of model tokens (input + output, as each journaled
-- answer's usage records them) per UTC day, and what a job does once it is
-- spent: wait for the next day (`wait`), or die `budget_exhausted`.
ALTER TABLE api_tokens ADD COLUMN daily_token_budget BIGINT
    CHECK (daily_token_budget > 0);
ALTER TABLE api_tokens ADD COLUMN budget_exhausted TEXT NOT NULL DEFAULT 'wait'
    CHECK (budget_exhausted IN ('wait', 'die'));

-- What each tenant with a budget spent each UTC day: added to by the
-- statement that records a model answer, in its commit (so an answer
-- recorded twice by two attempts is counted once: only the write that
-- completes the row adds). One row per tenant and day; tenants without a
-- budget write nothing here, so their answers contend on no shared row.
CREATE TABLE token_spend (
    tenant BIGINT NOT NULL,
    day    DATE NOT NULL,
    tokens BIGINT NOT NULL,
    PRIMARY KEY (tenant, day)
);
