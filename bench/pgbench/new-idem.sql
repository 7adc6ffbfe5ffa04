\set k random(1, 9000000000000000000)
BEGIN;
INSERT INTO keys_idem (source, event_id, payload_digest)
SELECT 'bench', 'e' || :k, sha256(int8send(:k)) WHERE pg_try_advisory_xact_lock(:k)
ON CONFLICT (source, event_id) DO NOTHING
RETURNING true;
INSERT INTO ledger (event_id, body) VALUES ('e' || :k, convert_to(repeat('x', 1000), 'UTF8')) RETURNING id;
UPDATE keys_idem SET response_status = 201, response_headers = '{"Content-Type": ["application/json"]}', response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now() WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL;
COMMIT;
