ALTER TABLE tool_calls
    ALTER COLUMN arguments_hash TYPE TEXT,
    ADD CONSTRAINT tool_calls_arguments_hash_check CHECK (arguments_hash ~ '^[0-9a-f]{64}$');
ALTER TABLE model_calls
    ALTER COLUMN request_hash TYPE TEXT,
    ADD CONSTRAINT model_calls_request_hash_check CHECK (request_hash ~ '^[0-9a-f]{64}$');
ALTER TABLE jobs
    ALTER COLUMN id TYPE TEXT,
    ALTER COLUMN request_hash TYPE TEXT,
    ALTER COLUMN workflow TYPE TEXT,
    ALTER COLUMN incarnation TYPE INTEGER,
    ALTER COLUMN workflow_version TYPE INTEGER,
    ADD CONSTRAINT jobs_id_check CHECK (id ~ '^[A-Za-z0-9_.:-]{1,200}$'),
    ADD CONSTRAINT jobs_request_hash_check CHECK (request_hash ~ '^[0-9a-f]{64}$'),
    ADD CONSTRAINT jobs_workflow_check CHECK (length(workflow) BETWEEN 1 AND 100),
    ADD CONSTRAINT jobs_incarnation_check CHECK (incarnation >= 1),
    ADD CONSTRAINT workflow_version_positive CHECK (workflow_version >= 1);
DROP DOMAIN positive_int;
DROP DOMAIN workflow_name;
DROP DOMAIN sha256_hex;
DROP DOMAIN job_id;
