DROP INDEX jobs_tags;
