package claims

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/driver"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// On a table distributed by Citus every claim inserts the key first, in
// the batch that begins its transaction after lock_timeout is set (two
// statements pipelined, one statement of two commands one by one), and
// takes no advisory lock: no TryLock, Lookup or Wait is ever sent.

// newCitusFake is newFake on a table distributed by Citus, its statements
// named "citus.<field>" ("citus.Set" for the joined SET statement).
func newCitusFake(pipelines bool) *fakePool {
	p := newFake(pipelines, nil)
	p.citus = true
	for _, joined := range []bool{false, true} {
		d := driver.NewCitusQueries(`"t"`, 2*time.Second, joined)
		for i, set := range d.Set {
			p.names[set] = []string{"citus.SetPropagate", "citus.SetWait"}[i]
			if joined {
				p.names[set] = "citus.Set"
			}
		}
		p.names[d.Claim], p.names[d.Read], p.names[d.ClaimLease], p.names[d.TakeOver] = "citus.Claim", "citus.Read", "citus.ClaimLease", "citus.TakeOver"
	}
	return p
}

func newCitusStore(t *testing.T, p *fakePool) *Store {
	s := newStore(t, p, nil)
	s.LockWait = 2 * time.Second
	return s
}

// citusFlows run do on both kinds of Pool, and compare the batches sent.
func citusFlows(t *testing.T, pipelined, oneByOne []string, script func(*fakePool), do func(t *testing.T, s *Store)) {
	for _, f := range []struct {
		name      string
		pipelines bool
		want      []string
	}{{"pipelined", true, pipelined}, {"one by one", false, oneByOne}} {
		t.Run(f.name, func(t *testing.T) {
			p := newCitusFake(f.pipelines)
			script(p)
			do(t, newCitusStore(t, p))
			assert.Equal(t, f.want, p.log)
		})
	}
}

func TestCitusNewKeyIsInsertedFirst(t *testing.T) {
	ctx := context.Background()
	citusFlows(t,
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.SetPropagate citus.SetWait citus.Claim", "CompleteOrFail COMMIT", "close"},
		[]string{"layout?", "distributed?", "BEGIN() citus.Set citus.Claim", "Complete", "COMMIT", "close"},
		func(p *fakePool) { p.answer("citus.Claim", values(true)) },
		func(t *testing.T, s *Store) {
			b, err := s.Begin(ctx, args)
			require.NoError(t, err)
			require.True(t, b.Won)
			require.NoError(t, b.Tx.Commit(ctx, args, 201, nil, []byte("ok")))
			require.NoError(t, b.Tx.Rollback(ctx))
		})
}

// A duplicate's INSERT inserts nothing (it waited for its original, which
// committed): its row, read without a lock, is the answer.
func TestCitusDuplicateReadsTheRow(t *testing.T) {
	ctx := context.Background()
	citusFlows(t,
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.SetPropagate citus.SetWait citus.Claim", "citus.Read", "close"},
		[]string{"layout?", "distributed?", "BEGIN() citus.Set citus.Claim", "citus.Read", "close"},
		func(p *fakePool) { p.answer("citus.Read", completed()) },
		func(t *testing.T, s *Store) {
			b, err := s.Begin(ctx, args)
			require.NoError(t, err)
			require.False(t, b.Won)
			assert.Equal(t, driver.Completed, b.Row.State)
			assert.Equal(t, []byte("stored"), b.Row.Body)
			require.NoError(t, b.Tx.Rollback(ctx))
		})
}

// The row was gone when read (deleted since the INSERT met it): Free, and
// the engine's Claim inserts again, which the unique index arbitrates.
func TestCitusRowGoneIsClaimedAgain(t *testing.T) {
	ctx := context.Background()
	citusFlows(t,
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.SetPropagate citus.SetWait citus.Claim", "citus.Read", "citus.Claim", "close"},
		[]string{"layout?", "distributed?", "BEGIN() citus.Set citus.Claim", "citus.Read", "citus.Claim", "close"},
		func(p *fakePool) {
			p.answer("citus.Claim", func(s *driver.Stmt) error { s.NoRow = true; return nil }, values(true))
		},
		func(t *testing.T, s *Store) {
			b, err := s.Begin(ctx, args)
			require.NoError(t, err)
			require.False(t, b.Won)
			require.Equal(t, driver.Free, b.Row.State)
			won, err := b.Tx.Claim(ctx, args)
			require.NoError(t, err)
			assert.True(t, won)
			require.NoError(t, b.Tx.Rollback(ctx))
		})
}

// A lease that ran out reads as LeaseExpired (no lock to ask), and the
// takeover is an UPDATE without the key's lock.
func TestCitusTakeOverTakesNoLock(t *testing.T) {
	ctx := context.Background()
	expired := values([]byte("digest"), int64(0), []byte(nil), []byte(nil), false, true, -time.Second)
	citusFlows(t,
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.SetPropagate citus.SetWait citus.Claim", "citus.Read", "citus.TakeOver", "close"},
		[]string{"layout?", "distributed?", "BEGIN() citus.Set citus.Claim", "citus.Read", "citus.TakeOver", "close"},
		func(p *fakePool) { p.answer("citus.Read", expired) },
		func(t *testing.T, s *Store) {
			b, err := s.Begin(ctx, args)
			require.NoError(t, err)
			require.Equal(t, driver.LeaseExpired, b.Row.State)
			won, err := b.Tx.TakeOver(ctx, args)
			require.NoError(t, err)
			assert.True(t, won)
			require.NoError(t, b.Tx.Rollback(ctx))
		})
}

// The lease claim commits on its own, in a transaction that sets its
// lock_timeout; a key not claimed is read without a lock.
func TestCitusLeaseClaim(t *testing.T) {
	ctx := context.Background()
	citusFlows(t,
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.SetPropagate citus.SetWait citus.ClaimLease COMMIT", "close",
			"BEGIN(read committed) citus.SetPropagate citus.SetWait citus.ClaimLease COMMIT", "citus.Read", "close"},
		[]string{"layout?", "distributed?", "BEGIN(read committed) citus.Set citus.ClaimLease COMMIT", "close",
			"BEGIN(read committed) citus.Set citus.ClaimLease COMMIT", "citus.Read", "close"},
		func(p *fakePool) {
			p.answer("citus.ClaimLease", values(false), func(s *driver.Stmt) error { s.NoRow = true; return nil })
			p.answer("citus.Read", completed())
		},
		func(t *testing.T, s *Store) {
			l, err := s.ClaimLease(ctx, args, time.Minute, time.Second, 42)
			require.NoError(t, err)
			assert.True(t, l.Won)
			assert.False(t, l.TookOver)
			assert.EqualValues(t, 42, l.Token)
			l, err = s.ClaimLease(ctx, args, time.Minute, time.Second, 43)
			require.NoError(t, err)
			assert.False(t, l.Won)
			assert.Equal(t, driver.Completed, l.Row.State)
		})
}

// A partitioned table distributed by Citus is refused, before any
// transaction.
func TestCitusPartitionedTableIsRefused(t *testing.T) {
	p := newCitusFake(true)
	p.partitioned = true
	s := newCitusStore(t, p)
	_, err := s.Begin(context.Background(), args)
	require.ErrorIs(t, err, driver.ErrDistributedPartitioned)
	_, err = s.ClaimLease(context.Background(), args, time.Minute, time.Second, 1)
	require.ErrorIs(t, err, driver.ErrDistributedPartitioned)
	assert.Equal(t, []string{"layout?", "distributed?"}, p.log)
}
