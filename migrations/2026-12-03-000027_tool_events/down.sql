DELETE FROM stream_events WHERE kind = 'tool';
ALTER TABLE stream_events DROP CONSTRAINT stream_events_kind_check;
ALTER TABLE stream_events ADD CONSTRAINT stream_events_kind_check
    CHECK (kind IN ('chunk', 'reset'));
