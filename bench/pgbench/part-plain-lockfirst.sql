-- The same on the plain table with the key's lock taken by a statement of its own.
\set k random(1, 9000000000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_try_advisory_xact_lock(:k);
INSERT INTO keys_plain (source, event_id, payload_digest)
SELECT 'bench', 'e' || :k, sha256(int8send(:k))
ON CONFLICT (source, event_id) DO NOTHING
RETURNING true;
UPDATE keys_plain SET response_status = 201, response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now()
WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL;
COMMIT;
