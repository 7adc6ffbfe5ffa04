-- Tables for the SQL-only comparison: idem's schema (schema.sql at the
-- root), once per path, and 1,000 completed keys for the duplicate scripts.
CREATE TABLE keys_inline (source text NOT NULL, event_id text NOT NULL, payload_digest bytea NOT NULL,
    response_status smallint, response_headers jsonb, response_body bytea,
    claimed_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz, PRIMARY KEY (source, event_id));
CREATE INDEX ON keys_inline USING brin (claimed_at);
CREATE TABLE keys_idem (LIKE keys_inline INCLUDING ALL);
CREATE TABLE keys_atend (LIKE keys_inline INCLUDING ALL);
CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, body bytea NOT NULL);
INSERT INTO keys_inline SELECT 'bench', 'seed:' || g, sha256(int8send(g)), 201,
    '{"Content-Type": ["application/json"]}', convert_to(repeat('y', 60), 'UTF8'), now(), now()
FROM generate_series(1, 1000) g;
INSERT INTO keys_idem SELECT * FROM keys_inline;
VACUUM ANALYZE;
