-- The tool ledger's identity is the call's position in the conversation
-- (job, turn, index): provider tool-call ids are recorded but not trusted to
-- be unique (some providers regenerate them or reuse one id for every call).
ALTER TABLE tool_calls DROP CONSTRAINT tool_calls_job_id_tool_call_id_turn_call_index_key;
ALTER TABLE tool_calls
    ADD COLUMN arguments       JSONB NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- set while one attempt executes the tool (see model_calls.in_flight_until)
    ADD COLUMN in_flight_until TIMESTAMPTZ,
    ADD COLUMN in_flight_epoch BIGINT,
    ADD COLUMN last_error      JSONB;
CREATE INDEX tool_calls_job_call_id ON tool_calls (job_id, tool_call_id);
