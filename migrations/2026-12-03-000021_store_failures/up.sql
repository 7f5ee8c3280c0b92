-- Store failures that ended an attempt, counted apart from its leases: a
-- job redriven or taken over many times is not dead at its first long outage.
ALTER TABLE jobs ADD COLUMN store_failures INT NOT NULL DEFAULT 0 CHECK (store_failures >= 0);
