DROP INDEX jobs_newest;
