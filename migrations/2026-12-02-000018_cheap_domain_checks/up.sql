-- The same shapes for ids and hashes, checked without a bounded repetition
-- (issue 13). PostgreSQL's regular-expression engine expands `{1,200}` into
-- 200 copies of its character class and `{64}` into 64, and builds its DFA
-- afresh at every match: one job id cost ~40 µs and one hash ~6 µs (200,000
-- values in psql: 7.9 s and 1.2 s), ~6.6 % of the server's CPU in
-- `onceflow bench` (perf: textregexeq under the insert's projection). A
-- length test plus an unbounded class accepts exactly the same values
-- (both count characters; same anchors, same class) in under 1 µs.
--
-- NOT VALID: every stored value passed the old check, which accepts the
-- same values, so there is nothing to re-read; new values are checked all
-- the same. (Validating would read `jobs` twice and `model_calls` and
-- `tool_calls` once with writes held off them.) `tests/it/intake.rs` pins
-- the edges and that only these checks remain.
ALTER DOMAIN job_id ADD CONSTRAINT job_id_shape
    CHECK (length(VALUE) BETWEEN 1 AND 200 AND VALUE ~ '^[A-Za-z0-9_.:-]+$') NOT VALID;
ALTER DOMAIN job_id DROP CONSTRAINT job_id_check;
ALTER DOMAIN sha256_hex ADD CONSTRAINT sha256_hex_shape
    CHECK (length(VALUE) = 64 AND VALUE ~ '^[0-9a-f]+$') NOT VALID;
ALTER DOMAIN sha256_hex DROP CONSTRAINT sha256_hex_check;
