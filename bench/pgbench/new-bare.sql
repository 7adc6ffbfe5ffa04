\set k random(1, 9000000000000000000)
BEGIN;
INSERT INTO ledger (event_id, body) VALUES ('e' || :k, convert_to(repeat('x', 1000), 'UTF8')) RETURNING id;
COMMIT;
