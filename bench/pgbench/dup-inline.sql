\set k random(1, 1000)
BEGIN;
INSERT INTO keys_inline (source, event_id, payload_digest) VALUES ('bench', 'seed:' || :k, sha256(int8send(:k))) ON CONFLICT (source, event_id) DO NOTHING RETURNING 1;
SELECT payload_digest, response_status, response_body FROM keys_inline WHERE source = 'bench' AND event_id = 'seed:' || :k;
ROLLBACK;
