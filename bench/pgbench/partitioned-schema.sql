-- Tables for docs/partitioning.md's "What it costs", SQL only: idem's
-- schema plain (keys_plain) and range-partitioned on claimed_at by day
-- (keys_part: 30 days back, the current day and 3 ahead, 34 partitions),
-- each with the same 300,000 completed keys over the last 30 days.
--   SCHEMA=partitioned-schema.sql SCRIPTS="part-plain part-plain-lockfirst part-nolookup part-idem part-named part-summary" \
--     ROUNDS=5 SECONDS_EACH=4 CLIENTS=16 bench/pgbench/run.sh
CREATE TABLE keys_plain (source text NOT NULL, event_id text NOT NULL, payload_digest bytea NOT NULL,
    response_status smallint, response_headers jsonb, response_body bytea,
    claimed_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz,
    lease_until timestamptz, lease_token bigint, PRIMARY KEY (source, event_id));
CREATE INDEX ON keys_plain USING brin (claimed_at);
CREATE TABLE keys_part (LIKE keys_plain INCLUDING DEFAULTS) PARTITION BY RANGE (claimed_at);
CREATE INDEX ON keys_part USING brin (claimed_at);
DO $$
DECLARE
    d int;
    day0 timestamptz := date_trunc('day', now());
BEGIN
    FOR d IN -30..3 LOOP
        EXECUTE format('CREATE TABLE keys_part_%s (LIKE keys_part INCLUDING DEFAULTS)', d + 30);
        EXECUTE format('ALTER TABLE keys_part_%s ADD PRIMARY KEY (source, event_id)', d + 30);
        EXECUTE format('ALTER TABLE keys_part ATTACH PARTITION keys_part_%s FOR VALUES FROM (%L) TO (%L)',
            d + 30, day0 + d * interval '1 day', day0 + (d + 1) * interval '1 day');
    END LOOP;
END $$;
INSERT INTO keys_plain (source, event_id, payload_digest, response_status, response_body, claimed_at, completed_at)
SELECT 'bench', 'old:' || g, sha256(int8send(g)), 201, convert_to(repeat('y', 60), 'UTF8'),
       now() - (g % 2592000) * interval '1 second', now()
FROM generate_series(1, 300000) g;
INSERT INTO keys_part SELECT * FROM keys_plain;
CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, body bytea NOT NULL);
VACUUM ANALYZE;

-- An experiment, not what idem does: blocked Bloom filters summarising the
-- keys of the 30 past partitions (keys_part_0 .. keys_part_29), one row
-- per block of 1,024 bits, 16 bits per key, 8 hashes (part-summary.sql
-- reads them). A claim could consult these instead of opening every past
-- partition, once a partition can take no more claims.
CREATE TABLE summ_meta (part int PRIMARY KEY, nblocks int NOT NULL);
CREATE TABLE summ (part int, block int, bits bit(1024) NOT NULL, PRIMARY KEY (part, block));
INSERT INTO summ_meta
SELECT p, (SELECT count(*) FROM keys_part WHERE tableoid = ('keys_part_' || p)::regclass) * 16 / 1024 + 1
FROM generate_series(0, 29) p;
INSERT INTO summ
SELECT m.part, h.block, bit_or(set_bit(repeat('0', 1024)::bit(1024), h.pos, 1))
FROM summ_meta m,
LATERAL (SELECT (abs(hashtextextended(k.source || ' ' || k.event_id, 0)) % m.nblocks)::int AS block,
                (abs(hashtextextended(k.source || ' ' || k.event_id, i)) % 1024)::int AS pos
         FROM keys_part k, generate_series(1, 8) i
         WHERE k.tableoid = ('keys_part_' || m.part)::regclass) h
GROUP BY 1, 2;
VACUUM ANALYZE summ;
VACUUM ANALYZE summ_meta;
