-- A tool call that may not be sent twice (an MCP tool marked neither
-- read-only nor idempotent) whose answer was lost: it may have run. The job
-- stops for a person's decision; only a redrive with confirm_unknown sends
-- it again (under the same key).
ALTER TYPE tool_call_status ADD VALUE IF NOT EXISTS 'unknown';
