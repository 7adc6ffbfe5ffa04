-- An experiment: the claim's statements naming the current partition
-- (keys_part_30), looking for the key nowhere else.
\set k random(1, 9000000000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_try_advisory_xact_lock(:k);
INSERT INTO keys_part_30 (source, event_id, payload_digest, claimed_at) SELECT 'bench', 'e' || :k, sha256(int8send(:k)), now() ON CONFLICT (source, event_id) DO NOTHING RETURNING true;
UPDATE keys_part_30 SET response_status = 201, response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now()
WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL;
COMMIT;
