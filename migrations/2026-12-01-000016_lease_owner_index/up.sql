-- The index on `lease_owner` served one statement, run when a node drains
-- (release every lease it holds), which the runnable index serves as well
-- (`finished_at IS NULL`). Keeping it cost every lease change an index
-- entry: an acquire could not be a HOT update, and a job handed off at
-- intake (born leased) paid one more index insert in the hot path.
DROP INDEX jobs_lease_owner;
