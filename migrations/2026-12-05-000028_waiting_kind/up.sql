-- `GET /v1/jobs?waiting={kind}` (the console's "waiting for approval"):
-- the jobs waiting for one kind of thing, newest first, without walking
-- every waiting job of the other kinds (a node may hold 100,000 timers).
CREATE INDEX jobs_waiting_kind ON jobs ((waiting->>'kind'), created_at DESC, id DESC)
    WHERE waiting IS NOT NULL;
