-- idem's database/sql claim on the partitioned table (driver.Queries:
-- TryLock, ClaimOrRead, CompleteClaimedNow), without the handler's write.
\set k random(1, 9000000000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_try_advisory_xact_lock(:k);
WITH r AS MATERIALIZED (
    SELECT payload_digest, response_status, response_headers, response_body, completed_at IS NOT NULL AS done,
           lease_until IS NOT NULL AND completed_at IS NULL AS leased, coalesce(lease_until > now(), false) AS live
    FROM keys_part WHERE source = 'bench' AND event_id = 'e' || :k
      AND claimed_at < statement_timestamp() + interval '1 minute' LIMIT 1),
ins AS (
    INSERT INTO keys_part (source, event_id, payload_digest, claimed_at)
    SELECT 'bench', 'e' || :k, sha256(int8send(:k)), now() WHERE true AND NOT EXISTS (SELECT FROM r)
    RETURNING true AS won)
SELECT coalesce((SELECT won FROM ins), false), r.payload_digest, r.response_status, r.response_headers,
       r.response_body, r.done, coalesce(r.leased, false), coalesce(r.live, false)
FROM (VALUES (1)) AS one LEFT JOIN r ON true;
UPDATE keys_part SET response_status = 201, response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now()
WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL AND claimed_at = now();
COMMIT;
