DROP TRIGGER job_history_followed ON job_history;
DROP FUNCTION onceflow_notify_followed();
DROP TABLE stream_watchers;
