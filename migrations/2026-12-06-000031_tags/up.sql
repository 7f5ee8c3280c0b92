-- A job's tags live in its request (`request->'tags'`, part of what makes
-- a resubmission identical); `GET /v1/jobs?tag=k:v` and a bulk cancel by
-- tag find them through this index (`@>`).
CREATE INDEX jobs_tags ON jobs USING gin ((request->'tags') jsonb_path_ops)
    WHERE request ? 'tags';
