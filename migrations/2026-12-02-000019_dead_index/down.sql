DROP INDEX jobs_dead;
