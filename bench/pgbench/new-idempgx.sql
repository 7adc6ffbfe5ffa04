-- idempgx's new event at READ COMMITTED, pipelined as pgx sends it: BEGIN,
-- the key's lock (without waiting) and a read of its row in one round trip;
-- the handler's write; the completed row and COMMIT in one round trip.
\set k random(1, 9000000000000000000)
\startpipeline
BEGIN;
SELECT pg_try_advisory_xact_lock(:k);
SELECT payload_digest, response_status, response_headers, response_body, completed_at IS NOT NULL
FROM keys_atend WHERE source = 'bench' AND event_id = 'e' || :k;
\endpipeline
INSERT INTO ledger (event_id, body) VALUES ('e' || :k, convert_to(repeat('x', 1000), 'UTF8')) RETURNING id;
\startpipeline
INSERT INTO keys_atend (source, event_id, payload_digest, response_status, response_headers, response_body, completed_at)
VALUES ('bench', 'e' || :k, sha256(int8send(:k)), 201, '{"Content-Type": ["application/json"]}', convert_to(repeat('y', 60), 'UTF8'), now());
COMMIT;
\endpipeline
