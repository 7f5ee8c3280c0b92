-- A fire time that made no job because its token's backlog was full is
-- recorded once, with why (`backlog_full`), and shown in the schedule's
-- latest jobs; `NULL`: the fire time made its job.
ALTER TABLE schedule_fires ADD COLUMN skipped TEXT;
