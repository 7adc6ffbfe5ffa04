\set k random(1, 1000)
BEGIN;
WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(:k) AS got),
ins AS (
    INSERT INTO keys_idem (source, event_id, payload_digest)
    SELECT 'bench', 'seed:' || :k, sha256(int8send(:k)) FROM l WHERE l.got
    ON CONFLICT (source, event_id) DO NOTHING
    RETURNING 1)
SELECT (SELECT got FROM l), EXISTS (SELECT 1 FROM ins),
       r.payload_digest, r.response_status, r.response_headers, r.response_body,
       r.completed_at IS NOT NULL
FROM (VALUES (1)) AS one
LEFT JOIN keys_idem AS r ON r.source = 'bench' AND r.event_id = 'seed:' || :k;
ROLLBACK;
