DROP INDEX jobs_waiting_kind;
