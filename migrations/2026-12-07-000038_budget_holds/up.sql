-- A budget is a reservation, not a check (see engine/src/store/budgets.rs).
--
-- Before a model call of a tenant with a budget is sent, it holds what it
-- may use (its input's estimate plus the output it allows) under its own
-- key, in the same transaction that reads the day's spend and the other
-- holds with the tenant's spend row locked: concurrent calls on any node
-- see each other's holds, so they cannot all pass a nearly spent budget.
-- The statement that records the answer deletes the hold as it adds the
-- usage; a call that never records one (it failed, its node died) lets its
-- hold lapse at `expires_at` (the call's in-flight bound). A call sent
-- again under the same key replaces its own hold.
CREATE TABLE budget_holds (
    call_key   TEXT PRIMARY KEY,
    tenant     BIGINT NOT NULL,
    day        DATE NOT NULL,
    tokens     BIGINT NOT NULL CHECK (tokens >= 0),
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX budget_holds_tenant ON budget_holds (tenant, day);
