-- An enum value cannot be dropped; calls left unknown become failed ones.
UPDATE tool_calls SET status = 'failed' WHERE status::text = 'unknown';
