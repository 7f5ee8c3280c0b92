-- Fewer index writes per job (issue 13; `bench` prints rows and WAL per job).
--
-- job_history: six rows per job, and each paid two index entries, its
-- BIGSERIAL primary key and (job_id, id) for reading a job's history. The
-- pair is unique on its own (id still comes from the sequence), so it is
-- the primary key now and the single index.
ALTER TABLE job_history DROP CONSTRAINT job_history_pkey;
DROP INDEX job_history_job;
ALTER TABLE job_history ADD PRIMARY KEY (job_id, id);

-- outbox: the index of failure events due for a send named `status` in its
-- predicate, so marking a completion delivered could never be a HOT update:
-- it wrote three index entries (two of them unique checks). The predicate
-- now names only `event`, which never changes; the statement that reads the
-- index still asks for `status = 'claimed'`, and a failure event that closes
-- gets `run_at = 'infinity'` (store/events.rs), so the claim's walk up to
-- now never passes closed ones. Closed ones from before are moved too.
DROP INDEX outbox_events_due;
UPDATE outbox SET run_at = 'infinity'
    WHERE event <> 'job.completed' AND status <> 'claimed';
CREATE INDEX outbox_events_due ON outbox (run_at) WHERE event <> 'job.completed';

-- Room for the update's new row version on its own page (a HOT update
-- needs it there): every job row is updated twice within moments of its
-- insert, every model call and outbox row once.
ALTER TABLE jobs SET (fillfactor = 50);
ALTER TABLE model_calls SET (fillfactor = 30);
ALTER TABLE outbox SET (fillfactor = 50);
