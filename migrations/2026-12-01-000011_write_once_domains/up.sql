-- Checks of columns written once (ids, hashes, names, versions) move from
-- table CHECK constraints to domains. PostgreSQL evaluates a table's CHECK
-- constraints on every UPDATE of a row, whatever the UPDATE changes, and a
-- job's row is updated at every checkpoint: the two regular-expression
-- matches on its id and request hash (and the model-call hash's) were about
-- 6 % of the server's CPU in `onceflow bench` (perf: textregexeq under
-- ExecConstraints). A domain's check runs when a value is assigned to the
-- column, so once per row here. The invariants are the same.
CREATE DOMAIN job_id AS TEXT CHECK (VALUE ~ '^[A-Za-z0-9_.:-]{1,200}$');
CREATE DOMAIN sha256_hex AS TEXT CHECK (VALUE ~ '^[0-9a-f]{64}$');
CREATE DOMAIN workflow_name AS TEXT CHECK (length(VALUE) BETWEEN 1 AND 100);
CREATE DOMAIN positive_int AS INTEGER CHECK (VALUE >= 1);

ALTER TABLE jobs
    DROP CONSTRAINT jobs_id_check,
    DROP CONSTRAINT jobs_request_hash_check,
    DROP CONSTRAINT jobs_workflow_check,
    DROP CONSTRAINT jobs_incarnation_check,
    DROP CONSTRAINT workflow_version_positive,
    ALTER COLUMN id TYPE job_id,
    ALTER COLUMN request_hash TYPE sha256_hex,
    ALTER COLUMN workflow TYPE workflow_name,
    ALTER COLUMN incarnation TYPE positive_int,
    ALTER COLUMN workflow_version TYPE positive_int;
ALTER TABLE model_calls
    DROP CONSTRAINT model_calls_request_hash_check,
    ALTER COLUMN request_hash TYPE sha256_hex;
ALTER TABLE tool_calls
    DROP CONSTRAINT tool_calls_arguments_hash_check,
    ALTER COLUMN arguments_hash TYPE sha256_hex;
