-- A streamed agent's tool calls show on its event stream: a `tool` row
-- under the call's key (`job:{id}:tool:{turn}:{index}`), its generation
-- the attempt that wrote it, its offset the phase (0 started, 1 finished
-- or failed, 2 replayed), its text a JSON object {phase, name,
-- tool_call_id}. One row per phase and attempt (the UNIQUE key).
ALTER TABLE stream_events DROP CONSTRAINT stream_events_kind_check;
ALTER TABLE stream_events ADD CONSTRAINT stream_events_kind_check
    CHECK (kind IN ('chunk', 'reset', 'tool'));
