-- The checks of migration 000011 again (same values; NOT VALID for the same
-- reason as up.sql).
ALTER DOMAIN sha256_hex ADD CONSTRAINT sha256_hex_check CHECK (VALUE ~ '^[0-9a-f]{64}$') NOT VALID;
ALTER DOMAIN sha256_hex DROP CONSTRAINT sha256_hex_shape;
ALTER DOMAIN job_id ADD CONSTRAINT job_id_check CHECK (VALUE ~ '^[A-Za-z0-9_.:-]{1,200}$') NOT VALID;
ALTER DOMAIN job_id DROP CONSTRAINT job_id_shape;
