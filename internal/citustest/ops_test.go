package citustest

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOperationsOnCitus runs Check, Stats and Sweep on a table distributed
// by Citus (Citus refused the check's subqueries in an aggregate's target
// list, and the sweep's FOR UPDATE SKIP LOCKED), and Distribute again.
func TestOperationsOnCitus(t *testing.T) {
	t.Parallel()
	c := citus(t, false)
	ts := c.newTables(t)
	db := c.coord.db
	ctx := context.Background()
	// 120 keys claimed 40 days ago, 30 claimed an hour ago, one committed
	// without an answer.
	_, err := db.Exec(`INSERT INTO ` + ts.idem + ` (source, event_id, payload_digest, response_status, response_body, claimed_at, completed_at)
SELECT 'test', 'old_' || g, sha256('{}'::bytea), 200, 'ok', now() - interval '40 days', now() - interval '40 days'
FROM generate_series(1, 120) g`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO ` + ts.idem + ` (source, event_id, payload_digest, response_status, response_body, claimed_at, completed_at)
SELECT 'test', 'young_' || g, sha256('{}'::bytea), 200, 'ok', now() - interval '1 hour', now() - interval '1 hour'
FROM generate_series(1, 30) g`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO ` + ts.idem + ` (source, event_id, payload_digest) VALUES ('test', 'unanswered', sha256('{}'::bytea))`)
	require.NoError(t, err)

	r, err := idemops.Check(ctx, db, idemops.CheckOptions{Table: ts.idem})
	require.NoError(t, err)
	assert.EqualValues(t, 151, r.Rows)
	assert.EqualValues(t, 120, r.OverdueRows)
	assert.EqualValues(t, 1, r.Unanswered)
	require.Len(t, r.UnansweredKeys, 1)
	assert.Equal(t, "unanswered", r.UnansweredKeys[0].Key.EventID)
	assert.Positive(t, r.TableBytes, "the shards' size, on the workers")
	assert.Equal(t, idemops.SeverityCritical, r.Severity(), "a key committed without an answer is critical")

	s, err := idemops.Stats(ctx, db, idemops.StatsOptions{Table: ts.idem})
	require.NoError(t, err)
	assert.EqualValues(t, 151, s.Rows)
	assert.EqualValues(t, 150, s.Completed)
	assert.EqualValues(t, 1, s.Unanswered)
	require.Len(t, s.Sources, 1)
	assert.Equal(t, "test", s.Sources[0].Source)
	assert.Positive(t, s.TableBytes)

	res, err := idemops.Sweep(ctx, db, idemops.SweepOptions{Table: ts.idem, BatchSize: 50, Pause: -1})
	require.NoError(t, err)
	assert.EqualValues(t, 120, res.Removed)
	assert.Equal(t, 3, res.Batches, "50, 50, then 20: fewer than a batch, the sweep stops")
	var left int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+ts.idem).Scan(&left))
	assert.Equal(t, 31, left)

	// The shards' counters of deleted rows, read on the workers: each
	// worker's backend reports its counts within a second or so of its
	// transaction's end (no event says when: polled, with a deadline).
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, err = idemops.Check(ctx, db, idemops.CheckOptions{Table: ts.idem})
		require.NoError(t, err)
		if r.Deleted >= 120 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	assert.EqualValues(t, 0, r.OverdueRows)
	assert.GreaterOrEqual(t, r.Deleted, int64(120), "the shards' counters of deleted rows, read on the workers")

	// Again: the table is left as it is.
	d, err := idemops.Distribute(ctx, db, idemops.DistributeOptions{Table: ts.idem, ColocateWith: ts.ledger})
	require.NoError(t, err)
	assert.False(t, d.Distributed)
	// A table in another colocation group is refused, saying how to move it.
	_, err = db.Exec(`CREATE TABLE ` + ts.ledger + `_other (id bigint NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS ` + ts.ledger + `_other`) })
	_, err = db.Exec(`SELECT create_distributed_table($1, 'id')`, ts.ledger+"_other")
	require.NoError(t, err)
	_, err = idemops.Distribute(ctx, db, idemops.DistributeOptions{Table: ts.idem, ColocateWith: ts.ledger + "_other"})
	require.ErrorContains(t, err, "update_distributed_table_colocation")
	// Migrating a distributed table again changes nothing and fails not.
	require.NoError(t, idem.Migrate(ctx, db, ts.idem))
}
