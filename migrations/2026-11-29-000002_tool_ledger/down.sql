DROP INDEX tool_calls_job_call_id;
ALTER TABLE tool_calls
    DROP COLUMN arguments,
    DROP COLUMN attempts,
    DROP COLUMN in_flight_until,
    DROP COLUMN in_flight_epoch,
    DROP COLUMN last_error;
ALTER TABLE tool_calls ADD UNIQUE (job_id, tool_call_id, turn, call_index);
