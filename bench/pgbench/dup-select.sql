-- A completed duplicate answered by one statement outside any transaction.
\set k random(1, 1000)
SELECT payload_digest, response_status, response_headers, response_body, completed_at IS NOT NULL
FROM keys_idem WHERE source = 'bench' AND event_id = 'seed:' || :k;
