-- The idempotency table. {{.Table}} and {{.ClaimedIndex}} are quoted
-- identifiers filled in by Migrate; every statement is safe to run again.
-- .Partitioned is set when Migrate creates a partitioned table
-- (docs/partitioning.md): range-partitioned on claimed_at, without a primary
-- key on the parent, since one would have to include claimed_at; each
-- partition gets its own PRIMARY KEY (source, event_id) (partition.go).
-- A later change to the schema is added below as another idempotent
-- statement (ALTER TABLE ... ADD COLUMN IF NOT EXISTS, CREATE INDEX IF NOT
-- EXISTS), so the same Migrate creates a new table and updates an old one.
--
-- One row per logical operation, keyed by (source, event_id): the primary
-- key is the lock. A row becomes visible to other transactions only when the
-- claim commits together with the handler's writes and the stored response,
-- so every committed row is complete; claims in flight are uncommitted
-- inserts, invisible to readers.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    source           text        NOT NULL,
    event_id         text        NOT NULL,
    payload_digest   bytea       NOT NULL, -- SHA-256 of the request body
    response_status  smallint,
    response_headers jsonb,                -- allow-listed headers, {"Name": ["v"]}
    response_body    bytea,                -- the exact bytes answered
    claimed_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz{{if not .Partitioned}},
    PRIMARY KEY (source, event_id){{end}}
){{if .Partitioned}} PARTITION BY RANGE (claimed_at){{end}};

-- Retention sweeps and health checks range over claimed_at, which only ever
-- grows with insertion order: a BRIN index costs almost nothing to keep and
-- does not stop the completing UPDATE from being a HOT update. The seed's
-- partial index on (claimed_at) WHERE completed_at IS NULL is left out on
-- purpose: its WHERE column changes in that UPDATE, which would turn every
-- completion into a non-HOT update with index writes, and in this design
-- incomplete rows are never committed, so it would index nothing useful.
CREATE INDEX IF NOT EXISTS {{.ClaimedIndex}} ON {{.Table}} USING brin (claimed_at);

-- Lease mode (Options.Lease): a claim commits at once as an in-progress row
-- whose lease ends at lease_until, owned by lease_token, a random fencing
-- token; the answer is stored only by the token that still owns the key.
-- Both are NULL on every row of single-transaction mode.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS lease_until timestamptz;
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS lease_token bigint;
