\set k random(1, 9000000000000000000)
SELECT payload_digest, response_status, response_headers, response_body FROM keys_idem WHERE source = 'bench' AND event_id = 'e' || :k;
BEGIN;
WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(:k) AS got),
ins AS (
    INSERT INTO keys_idem (source, event_id, payload_digest)
    SELECT 'bench', 'e' || :k, sha256(int8send(:k)) FROM l WHERE l.got
    ON CONFLICT (source, event_id) DO NOTHING
    RETURNING 1)
SELECT (SELECT got FROM l), EXISTS (SELECT 1 FROM ins),
       r.payload_digest, r.response_status, r.response_headers, r.response_body,
       r.completed_at IS NOT NULL
FROM (VALUES (1)) AS one
LEFT JOIN keys_idem AS r ON r.source = 'bench' AND r.event_id = 'e' || :k;
INSERT INTO ledger (event_id, body) VALUES ('e' || :k, convert_to(repeat('x', 1000), 'UTF8')) RETURNING id;
UPDATE keys_idem SET response_status = 201, response_headers = '{"Content-Type": ["application/json"]}', response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now() WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL;
COMMIT;
