-- The version of its workflow a job started on. A node runs a job only with
-- that version (acquire filters on (workflow, workflow_version)), so a deploy
-- that changes a workflow's body never replays an old journal against new code.
ALTER TABLE jobs ADD COLUMN workflow_version INTEGER NOT NULL DEFAULT 1
    CONSTRAINT workflow_version_positive CHECK (workflow_version >= 1);
