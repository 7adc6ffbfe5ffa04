package idem

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/claims"
	"github.com/pgidem/idem/internal/driver"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The seed's concurrency test, on two real connections: while A holds an
// uncommitted claim, B's claim does not win and does not block, and B sees
// the key in flight; once A commits, a new claim sees A's completed row. The
// race the primary key settles can only show up with two connections.
func TestOnlyOneOfTwoConcurrentClaimsWins(t *testing.T) {
	t.Parallel()
	k := Key{Source: "acme", EventID: "evt_91f2"}
	_, _, d, args := claimStore(t, nil, k, `{"order_id":"o1"}`)
	ctx := context.Background()

	begun, err := d.Begin(ctx, args)
	require.NoError(t, err)
	a := begun.Tx
	defer a.Rollback(ctx) //nolint:errcheck // ends a finished tx in the failure paths only
	assert.True(t, begun.Won, "A wins the free key")

	busy, err := d.Begin(ctx, args)
	require.NoError(t, err, "B neither blocks nor fails on A's uncommitted row")
	assert.False(t, busy.Won)
	assert.Equal(t, driver.InFlight, busy.Row.State, "B sees the claim in flight, its uncommitted row invisible")
	require.NoError(t, busy.Tx.Rollback(ctx))

	require.NoError(t, a.Commit(ctx, args, 200, []byte(`{}`), []byte(`{"status":"recorded"}`)))

	done, err := d.Begin(ctx, args)
	require.NoError(t, err)
	defer done.Tx.Rollback(ctx) //nolint:errcheck
	assert.False(t, done.Won, "a completed key is never claimed again")
	assert.Equal(t, driver.Completed, done.Row.State, "and its answer is there")
	assert.Equal(t, []byte(`{"status":"recorded"}`), done.Row.Body)
	assert.Equal(t, 200, done.Row.Status)
	assert.Equal(t, args.Digest, done.Row.Digest)
}

// The snapshot trap of DESIGN-NOTES: a statement that waited for a
// committing original cannot see its row in its own snapshot. The middleware
// reads with a new statement after the wait, which does.
func TestLookupAfterTheWaitSeesTheCommittedRow(t *testing.T) {
	t.Parallel()
	k := Key{Source: "acme", EventID: "evt_wait"}
	_, _, d, args := claimStore(t, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, k, "x")
	ctx := context.Background()

	begun, err := d.Begin(ctx, args)
	require.NoError(t, err)
	require.True(t, begun.Won)
	a := begun.Tx

	busy, err := d.Begin(ctx, args)
	require.NoError(t, err)
	b := busy.Tx
	defer b.Rollback(ctx) //nolint:errcheck
	require.False(t, busy.Won)

	waited := make(chan error)
	var row driver.Row
	go func() {
		var err error
		row, err = b.Wait(ctx, args, time.Minute)
		waited <- err
	}()
	require.NoError(t, a.Commit(ctx, args, 201, []byte(`{}`), []byte("done")))
	require.NoError(t, <-waited)
	assert.Equal(t, driver.Completed, row.State)
	assert.Equal(t, 201, row.Status)
	assert.Equal(t, []byte("done"), row.Body)

	var lockTimeout string
	require.NoError(t, b.Handle().(*sql.Tx).QueryRowContext(ctx, "SHOW lock_timeout").Scan(&lockTimeout))
	assert.Equal(t, "0", lockTimeout, "the wait gave the transaction back its lock_timeout")
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

// A lease-mode heartbeat moves the end of its own token's lease, on either
// layout, and changes nothing once another delivery took the key over.
func TestExtendLeaseMovesOnlyItsOwnTokensLease(t *testing.T) {
	t.Parallel()
	k := Key{Source: "acme", EventID: "evt_heartbeat"}
	db, tbl, d, args := claimStore(t, nil, k, "x")
	ctx := context.Background()
	l, err := d.ClaimLease(ctx, args, time.Second, time.Second, 42)
	require.NoError(t, err)
	require.True(t, l.Won)

	require.NoError(t, d.ExtendLease(ctx, args, 42, time.Hour))
	var left time.Duration
	leaseLeft := func() time.Duration {
		var us int64
		require.NoError(t, db.QueryRowContext(ctx, `SELECT extract(epoch FROM lease_until - now())::bigint * 1000000 FROM `+tbl.Quoted+
			` WHERE source = $1 AND event_id = $2`, k.Source, k.EventID).Scan(&us))
		return time.Duration(us) * time.Microsecond
	}
	left = leaseLeft()
	assert.Greater(t, left, 59*time.Minute, "the lease now runs an hour")

	require.ErrorIs(t, d.ExtendLease(ctx, args, 43, 2*time.Hour), driver.ErrFenced, "another token extends nothing")
	assert.Equal(t, left.Round(time.Minute), leaseLeft().Round(time.Minute))
}

// claimStore is a test's own table, the claims on it through the
// database/sql adapter with opts, and the args of key k's claim with the
// digest of body.
func claimStore(t *testing.T, opts *sql.TxOptions, k Key, body string) (*sql.DB, table, *claims.Store, *driver.Args) {
	t.Helper()
	db := openTestDB(t)
	tbl, err := parseTable(newTestTable(t, db))
	require.NoError(t, err)
	d, err := claims.New(sqlPool{db}, driver.NewQueries(tbl.Quoted), opts)
	require.NoError(t, err)
	digest := sha256.Sum256([]byte(body))
	return db, tbl, d, &driver.Args{Source: k.Source, EventID: k.EventID, Digest: digest[:], Lock: tbl.lockID(k)}
}
