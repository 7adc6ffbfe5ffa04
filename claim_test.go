package idem

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The seed's concurrency test, on two real connections: while A holds an
// uncommitted claim, B's claim does not win and does not block, and B sees
// the key in flight; once A commits, a new claim sees A's completed row. The
// race the primary key settles can only show up with two connections.
func TestOnlyOneOfTwoConcurrentClaimsWins(t *testing.T) {
	t.Parallel()
	db := openTestDB(t)
	tbl, err := parseTable(newTestTable(t, db))
	require.NoError(t, err)
	q := newQueries(tbl)
	ctx := context.Background()
	k := Key{Source: "acme", EventID: "evt_91f2"}
	body := []byte(`{"order_id":"o1"}`)
	digest := sha256.Sum256(body)
	lock := tbl.lockID(k)

	a, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer a.Rollback() //nolint:errcheck // ends a finished tx in the failure paths only
	b, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer b.Rollback() //nolint:errcheck

	won, err := q.doClaim(ctx, a, k, digest[:], lock)
	require.NoError(t, err)
	assert.True(t, won, "A wins the free key")

	won, err = q.doClaim(ctx, b, k, digest[:], lock)
	require.NoError(t, err, "B neither blocks nor fails on A's uncommitted row")
	assert.False(t, won)
	busy, err := q.doLookup(ctx, b, k, lock)
	require.NoError(t, err)
	assert.False(t, busy.gotLock, "B sees the claim in flight")
	assert.False(t, busy.visible, "A's uncommitted row is invisible to B")
	require.NoError(t, b.Rollback())

	require.NoError(t, q.doComplete(ctx, a, k, 200, []byte(`{}`), []byte(`{"status":"recorded"}`)))
	require.NoError(t, a.Commit())

	c, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer c.Rollback() //nolint:errcheck
	won, err = q.doClaim(ctx, c, k, digest[:], lock)
	require.NoError(t, err)
	assert.False(t, won, "a completed key is never claimed again")
	done, err := q.doLookup(ctx, c, k, lock)
	require.NoError(t, err)
	assert.True(t, done.completed, "and its answer is there")
	assert.Equal(t, []byte(`{"status":"recorded"}`), done.stored.body)
	assert.Equal(t, 200, done.stored.status)
	assert.Equal(t, digest[:], done.stored.digest)
}

// The snapshot trap of DESIGN-NOTES: a statement that waited for a
// committing original cannot see its row in its own snapshot. The middleware
// reads with a new statement after the wait, which does.
func TestLookupAfterTheWaitSeesTheCommittedRow(t *testing.T) {
	t.Parallel()
	db := openTestDB(t)
	tbl, err := parseTable(newTestTable(t, db))
	require.NoError(t, err)
	q := newQueries(tbl)
	ctx := context.Background()
	k := Key{Source: "acme", EventID: "evt_wait"}
	digest := sha256.Sum256([]byte("x"))
	lock := tbl.lockID(k)

	a, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	won, err := q.doClaim(ctx, a, k, digest[:], lock)
	require.NoError(t, err)
	require.True(t, won)

	b, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	require.NoError(t, err)
	defer b.Rollback() //nolint:errcheck
	won, err = q.doClaim(ctx, b, k, digest[:], lock)
	require.NoError(t, err)
	require.False(t, won)

	waited := make(chan error)
	go func() { _, err := q.doWait(ctx, b, lock, 60e9); waited <- err }()
	require.NoError(t, q.doComplete(ctx, a, k, 201, []byte(`{}`), []byte("done")))
	require.NoError(t, a.Commit())
	require.NoError(t, <-waited)

	row, err := q.doLookup(ctx, b, k, lock)
	require.NoError(t, err)
	assert.True(t, row.gotLock)
	assert.True(t, row.visible)
	assert.True(t, row.completed)
	assert.Equal(t, 201, row.stored.status)
	assert.Equal(t, []byte("done"), row.stored.body)
}

func TestLockIDIgnoresHowTheTableIsSpelled(t *testing.T) {
	k := Key{Source: "stripe", EventID: "evt_1"}
	a, err := parseTable("webhook_idempotency")
	require.NoError(t, err)
	b, err := parseTable("public.webhook_idempotency")
	require.NoError(t, err)
	c, err := parseTable("")
	require.NoError(t, err)
	assert.Equal(t, a.lockID(k), b.lockID(k))
	assert.Equal(t, a.lockID(k), c.lockID(k))
	assert.NotEqual(t, a.lockID(k), a.lockID(Key{Source: "stripe", EventID: "evt_2"}))
	assert.NotEqual(t, a.lockID(Key{Source: "ab", EventID: "c"}), a.lockID(Key{Source: "a", EventID: "bc"}), "the separator counts")
}
