-- On the partitioned table, a claim that looks for the key nowhere (no
-- global suppression): what going through the partitioned table costs.
\set k random(1, 9000000000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_try_advisory_xact_lock(:k);
INSERT INTO keys_part (source, event_id, payload_digest, claimed_at)
SELECT 'bench', 'e' || :k, sha256(int8send(:k)), now()
RETURNING true;
UPDATE keys_part SET response_status = 201, response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now()
WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL AND claimed_at = now();
COMMIT;
