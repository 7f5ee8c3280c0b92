-- Jobs someone follows (`GET /v1/jobs/{id}/events`), one row per open
-- stream. A statement that adds history rows (every transition) NOTIFYs
-- `onceflow_stream` for the followed jobs among them, so a watcher on any
-- node learns of a state change at once instead of polling. With no stream
-- open anywhere the trigger costs one probe of an empty table per statement.
CREATE TABLE stream_watchers (
    id        BIGSERIAL PRIMARY KEY,
    job_id    TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    opened_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX stream_watchers_job ON stream_watchers (job_id);

CREATE FUNCTION onceflow_notify_followed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM stream_watchers) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('onceflow_stream', a.job_id || ' ' || a.last)
    FROM (SELECT job_id, max(id) AS last FROM added GROUP BY job_id) a
    WHERE EXISTS (SELECT 1 FROM stream_watchers w WHERE w.job_id = a.job_id);
    RETURN NULL;
END
$$;

CREATE TRIGGER job_history_followed AFTER INSERT ON job_history
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION onceflow_notify_followed();
