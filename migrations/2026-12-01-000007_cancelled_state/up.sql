-- A new final state. It gets a migration of its own: a value added to an
-- enum cannot be used in the transaction that adds it (the next migration
-- uses it). Nodes of an older build never lease a cancelled job (it is
-- finished), so they can run beside this one while it rolls out.
ALTER TYPE job_state ADD VALUE IF NOT EXISTS 'cancelled';
