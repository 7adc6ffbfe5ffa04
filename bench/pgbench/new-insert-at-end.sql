-- A variant of idem's path: the first statement takes the key's advisory
-- lock and looks the key up; the completed row is INSERTed once, at the end,
-- instead of INSERTed at the claim and UPDATEd at the end.
\set k random(1, 9000000000000000000)
BEGIN;
SELECT pg_try_advisory_xact_lock(:k), r.payload_digest, r.response_status, r.response_headers, r.response_body
FROM (VALUES (1)) AS one LEFT JOIN keys_atend AS r ON r.source = 'bench' AND r.event_id = 'e' || :k;
INSERT INTO ledger (event_id, body) VALUES ('e' || :k, convert_to(repeat('x', 1000), 'UTF8')) RETURNING id;
INSERT INTO keys_atend (source, event_id, payload_digest, response_status, response_headers, response_body, completed_at)
VALUES ('bench', 'e' || :k, sha256(int8send(:k)), 201, '{"Content-Type": ["application/json"]}', convert_to(repeat('y', 60), 'UTF8'), now())
ON CONFLICT (source, event_id) DO NOTHING;
COMMIT;
