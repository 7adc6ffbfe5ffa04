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
// uncommitted claim, B's claim does not win and does not block; once A
// commits, B's claim sees A's completed row; the race the primary key settles
// can only show up with two connections.
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

	first, err := q.doClaim(ctx, a, k, digest[:], lock)
	require.NoError(t, err)
	assert.True(t, first.won, "A wins the free key")

	second, err := q.doClaim(ctx, b, k, digest[:], lock)
	require.NoError(t, err, "B neither blocks nor fails on A's uncommitted row")
	assert.False(t, second.won)
	assert.False(t, second.gotLock, "B sees the claim in flight")
	assert.False(t, second.visible)
	require.NoError(t, b.Rollback())

	require.NoError(t, q.doComplete(ctx, a, k, 200, []byte(`{}`), []byte(`{"status":"recorded"}`)))
	require.NoError(t, a.Commit())

	c, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer c.Rollback() //nolint:errcheck
	third, err := q.doClaim(ctx, c, k, digest[:], lock)
	require.NoError(t, err)
	assert.False(t, third.won, "a completed key is never claimed again")
	assert.True(t, third.completed, "and its answer comes back in the same statement")
	assert.Equal(t, []byte(`{"status":"recorded"}`), third.stored.body)
	assert.Equal(t, 200, third.stored.status)
	assert.Equal(t, digest[:], third.stored.digest)
}

// The snapshot trap of DESIGN-NOTES: a claim statement that waited for (or
// raced with) a committing original cannot see its row in its own snapshot.
// The middleware then reads with a new statement, which does.
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
	require.True(t, won.won)

	b, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	require.NoError(t, err)
	defer b.Rollback() //nolint:errcheck
	busy, err := q.doClaim(ctx, b, k, digest[:], lock)
	require.NoError(t, err)
	require.False(t, busy.gotLock)

	waited := make(chan error)
	go func() { waited <- q.doWait(ctx, b, lock, 60e9) }()
	require.NoError(t, q.doComplete(ctx, a, k, 201, []byte(`{}`), []byte("done")))
	require.NoError(t, a.Commit())
	require.NoError(t, <-waited)

	row, err := q.doLookup(ctx, b, k)
	require.NoError(t, err)
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
