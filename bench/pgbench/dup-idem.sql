\set k random(1, 1000)
BEGIN;
INSERT INTO keys_idem (source, event_id, payload_digest)
SELECT 'bench', 'seed:' || :k, sha256(int8send(:k)) WHERE pg_try_advisory_xact_lock(:k)
ON CONFLICT (source, event_id) DO NOTHING
RETURNING true;
SELECT pg_try_advisory_xact_lock(:k), r.payload_digest, r.response_status, r.response_headers,
       r.response_body, r.completed_at IS NOT NULL
FROM (VALUES (1)) AS one
LEFT JOIN keys_idem AS r ON r.source = 'bench' AND r.event_id = 'seed:' || :k;
ROLLBACK;
