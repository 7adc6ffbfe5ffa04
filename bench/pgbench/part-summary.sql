-- An experiment: the claim of part-named.sql that also consults the
-- summaries of the 30 past partitions (partitioned-schema.sql), and
-- inserts only when none of them may hold the key.
\set k random(1, 9000000000000000000)
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_try_advisory_xact_lock(:k);
WITH h AS MATERIALIZED (SELECT abs(hashtextextended(key, 0)) AS h0, ARRAY[(abs(hashtextextended(key, 1)) % 1024)::int, (abs(hashtextextended(key, 2)) % 1024)::int, (abs(hashtextextended(key, 3)) % 1024)::int, (abs(hashtextextended(key, 4)) % 1024)::int, (abs(hashtextextended(key, 5)) % 1024)::int, (abs(hashtextextended(key, 6)) % 1024)::int, (abs(hashtextextended(key, 7)) % 1024)::int, (abs(hashtextextended(key, 8)) % 1024)::int] AS p FROM (SELECT 'bench e' || :k AS key) x),
maybe AS MATERIALIZED (SELECT m.part FROM h CROSS JOIN summ_meta m CROSS JOIN LATERAL (SELECT bits FROM summ WHERE summ.part = m.part AND summ.block = (h.h0 % m.nblocks)::int LIMIT 1) s
  WHERE get_bit(s.bits, h.p[1]) = 1 AND get_bit(s.bits, h.p[2]) = 1 AND get_bit(s.bits, h.p[3]) = 1 AND get_bit(s.bits, h.p[4]) = 1 AND get_bit(s.bits, h.p[5]) = 1 AND get_bit(s.bits, h.p[6]) = 1 AND get_bit(s.bits, h.p[7]) = 1 AND get_bit(s.bits, h.p[8]) = 1),
r AS MATERIALIZED (SELECT payload_digest, response_status, response_headers, response_body, completed_at IS NOT NULL AS done FROM keys_part_30 WHERE source = 'bench' AND event_id = 'e' || :k),
ins AS (INSERT INTO keys_part_30 (source, event_id, payload_digest, claimed_at) SELECT 'bench', 'e' || :k, sha256(int8send(:k)), now() WHERE NOT EXISTS (SELECT FROM r) AND NOT EXISTS (SELECT FROM maybe) RETURNING true AS won)
SELECT coalesce((SELECT won FROM ins), false), (SELECT count(*) FROM maybe), r.payload_digest FROM (VALUES (1)) AS one LEFT JOIN r ON true;
UPDATE keys_part_30 SET response_status = 201, response_body = convert_to(repeat('y', 60), 'UTF8'), completed_at = now()
WHERE source = 'bench' AND event_id = 'e' || :k AND completed_at IS NULL;
COMMIT;
