package idem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Middleware.Do's behaviour, on the suite's adapter (IDEM_ADAPTER) and
// layout (IDEM_LAYOUT), in single-transaction and lease mode: a delivery
// that does not come over HTTP takes the same path as one that does.

// doKey is the key of the event id under the fixtures' source.
func doKey(id string) idem.Key { return idem.Key{Source: "test", EventID: id} }

// ledgerFn is a function for Do that appends the event to f's ledger in
// the claim's transaction and returns the new row's id: a second run would
// show as a second row and another Value. It counts its runs in f.runs.
func (f *fixture) ledgerFn(id string) func(context.Context) ([]byte, error) {
	return func(ctx context.Context) ([]byte, error) {
		f.runs.Add(1)
		tx, ok := txFrom(ctx)
		if !ok {
			return nil, errors.New("no transaction in fn's context")
		}
		var n int64
		if err := tx.QueryRowContext(ctx, `INSERT INTO `+f.ledger+` (event_id, body) VALUES ($1, 'do') RETURNING id`, id).Scan(&n); err != nil {
			return nil, err
		}
		return []byte(fmt.Sprintf("ledger row %d", n)), nil
	}
}

// heldLedgerFn is ledgerFn whose first run writes, then waits at g, then
// ends with end (nil: returns its Value).
func (f *fixture) heldLedgerFn(id string, g *gate, end func(ctx context.Context) error) func(context.Context) ([]byte, error) {
	first := atomic.Bool{}
	return func(ctx context.Context) ([]byte, error) {
		v, err := f.ledgerFn(id)(ctx)
		if err != nil || !first.CompareAndSwap(false, true) {
			return v, err
		}
		g.hold()
		if end != nil {
			if err := end(ctx); err != nil {
				return nil, err
			}
		}
		return v, nil
	}
}

type doReply struct {
	res idem.Result
	err error
}

// doAsync calls mw.Do in the background; its reply arrives on the channel.
func doAsync(mw *idem.Middleware, key idem.Key, payload string, fn func(context.Context) ([]byte, error)) <-chan doReply {
	c := make(chan doReply, 1)
	go func() {
		res, err := mw.Do(context.Background(), key, []byte(payload), fn)
		c <- doReply{res, err}
	}()
	return c
}

// outcomes lists what the Observer saw, in order.
func (f *fixture) outcomes() []idem.Outcome {
	var out []idem.Outcome
	for _, o := range f.observations() {
		out = append(out, o.Outcome)
	}
	return out
}

func TestDoRunsOnceAndReplays(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 20 * time.Second} {
		t.Run(fmt.Sprintf("lease %v", lease), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idem.Options{Lease: lease}, nil)
			ctx := context.Background()
			first, err := f.mw.Do(ctx, doKey("evt_1"), []byte(`{"n":1}`), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.False(t, first.Replayed)
			assert.Equal(t, "ledger row 1", string(first.Value))

			again, err := f.mw.Do(ctx, doKey("evt_1"), []byte(`{"n":1}`), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.True(t, again.Replayed)
			assert.Equal(t, first.Value, again.Value)
			cached, err := f.mw.Do(ctx, doKey("evt_1"), []byte(`{"n":1}`), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.True(t, cached.Replayed)
			assert.Equal(t, first.Value, cached.Value)
			cached.Value[0] = 'X' // the caller's copy, not the cache's

			other, err := f.mw.Do(ctx, doKey("evt_1"), []byte(`{"n":2}`), f.ledgerFn("evt_1"))
			assert.ErrorIs(t, err, idem.ErrPayloadMismatch)
			assert.False(t, idem.Retryable(err))
			assert.Zero(t, other)

			again, err = f.mw.Do(ctx, doKey("evt_1"), []byte(`{"n":1}`), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.Equal(t, "ledger row 1", string(again.Value))

			assert.Equal(t, int64(1), f.runs.Load(), "fn ran once")
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, 1, f.keys())
			assert.Equal(t, []idem.Outcome{idem.OutcomeCompleted, idem.OutcomeReplayed, idem.OutcomeReplayed,
				idem.OutcomeMismatch, idem.OutcomeReplayed}, f.outcomes())
			obs := f.observations()
			for _, o := range obs {
				assert.Equal(t, "", o.Method, "a call of Do has no method")
				assert.Equal(t, doKey("evt_1"), o.Key)
			}
			assert.Equal(t, http.StatusOK, obs[0].Status)
			assert.False(t, obs[1].Cached, "the first replay reads the database")
			assert.True(t, obs[2].Cached, "the next ones are served from memory")
			assert.Equal(t, http.StatusUnprocessableEntity, obs[3].Status)

			var status int
			var headers, body string
			require.NoError(t, f.db.QueryRow(`SELECT response_status, response_headers::text, convert_from(response_body, 'UTF8')
				FROM "`+f.table+`" WHERE source = 'test' AND event_id = 'evt_1' AND completed_at IS NOT NULL`).Scan(&status, &headers, &body))
			assert.Equal(t, 200, status, "Do's answers are stored as 200")
			assert.Equal(t, "{}", headers)
			assert.Equal(t, "ledger row 1", body)
		})
	}
}

// One key, HTTP and Do: each replays what the other completed.
func TestDoAndHTTPShareAKeysAnswer(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	res, err := f.mw.Do(context.Background(), doKey("evt_do"), []byte("{}"), f.ledgerFn("evt_do"))
	require.NoError(t, err)
	r := f.post("evt_do", "{}")
	assert.Equal(t, http.StatusOK, r.status)
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
	assert.Equal(t, res.Value, r.body)
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_do", `{"other":1}`).status)

	byHTTP := f.post("evt_http", "{}")
	require.Equal(t, http.StatusCreated, byHTTP.status)
	res, err = f.mw.Do(context.Background(), doKey("evt_http"), []byte("{}"), f.ledgerFn("evt_http"))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, byHTTP.body, res.Value, "the HTTP answer's body")
	assert.Equal(t, int64(2), f.runs.Load())
	assert.Equal(t, 2, f.ledgerRows())
}

var errBoom = errors.New("downstream said no")

// fn's error: returned wrapped, everything rolled back, nothing stored; the
// next delivery runs fn again.
func TestDoRollsBackWhenFnFails(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 20 * time.Second} {
		t.Run(fmt.Sprintf("lease %v", lease), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idem.Options{Lease: lease}, nil)
			res, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
				if _, err := f.ledgerFn("evt_1")(ctx); err != nil {
					return nil, err
				}
				return []byte("half done"), errBoom
			})
			require.ErrorIs(t, err, errBoom)
			assert.True(t, idem.Retryable(err))
			assert.Zero(t, res)
			assert.Zero(t, f.ledgerRows(), "fn's write rolled back")
			assert.Zero(t, f.keys(), "nothing stored")

			res, err = f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.False(t, res.Replayed, "the redelivery ran fn again")
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, []idem.Outcome{idem.OutcomeRolledBack, idem.OutcomeCompleted}, f.outcomes())
			assert.ErrorIs(t, f.observations()[0].Err, errBoom)
		})
	}
}

// A panic in fn rolls everything back and goes on from Do.
func TestDoPanicRollsBackAndPropagates(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 20 * time.Second} {
		t.Run(fmt.Sprintf("lease %v", lease), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idem.Options{Lease: lease}, nil)
			assert.PanicsWithValue(t, "fn blew up", func() {
				_, _ = f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
					_, _ = f.ledgerFn("evt_1")(ctx)
					panic("fn blew up")
				})
			})
			assert.Zero(t, f.ledgerRows())
			assert.Zero(t, f.keys())
			res, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
			require.NoError(t, err, "the key is free again")
			assert.False(t, res.Replayed)
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, []idem.Outcome{idem.OutcomeRolledBack, idem.OutcomeCompleted}, f.outcomes())
		})
	}
}

// fn past HandlerTimeout, or past the end of the caller's ctx: rolled back,
// ErrHandlerTimeout with the context's error.
func TestDoTimesOut(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 20 * time.Second} {
		t.Run(fmt.Sprintf("HandlerTimeout, lease %v", lease), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idem.Options{Lease: lease, HandlerTimeout: 300 * time.Millisecond}, nil)
			_, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
				if _, err := f.ledgerFn("evt_1")(ctx); err != nil {
					return nil, err
				}
				<-ctx.Done()
				return []byte("too late"), nil
			})
			require.ErrorIs(t, err, idem.ErrHandlerTimeout)
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.True(t, idem.Retryable(err))
			assert.Zero(t, f.ledgerRows())
			assert.Zero(t, f.keys())
			_, err = f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
			require.NoError(t, err)
			assert.Equal(t, 1, f.ledgerRows())
		})
		t.Run(fmt.Sprintf("caller cancels, lease %v", lease), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, idem.Options{Lease: lease}, nil)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			entered := make(chan struct{})
			go func() { <-entered; cancel() }()
			_, err := f.mw.Do(ctx, doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
				if _, err := f.ledgerFn("evt_1")(ctx); err != nil {
					return nil, err
				}
				close(entered)
				<-ctx.Done()
				return nil, ctx.Err()
			})
			require.ErrorIs(t, err, idem.ErrHandlerTimeout)
			assert.ErrorIs(t, err, context.Canceled)
			assert.Zero(t, f.ledgerRows())
			assert.Zero(t, f.keys())
		})
	}
}

// A second delivery while the first runs: it waits LockWait, in memory on
// the same instance or in PostgreSQL from another, and gets ErrInFlight
// (nothing ran); with a longer LockWait it gets the first's Value. In lease
// mode a live lease answers ErrInFlight at once.
func TestDoInFlight(t *testing.T) {
	t.Parallel()
	for _, where := range []string{"same instance", "another instance"} {
		t.Run(where, func(t *testing.T) {
			t.Parallel()
			g := newGate()
			f := newFixture(t, idem.Options{LockWait: time.Minute}, nil)
			t.Cleanup(g.open)
			origMW, _ := f.serveOn(f.db, idem.Options{LockWait: 50 * time.Millisecond})
			short := origMW
			if where == "another instance" {
				short, _ = f.serveOn(f.db, idem.Options{LockWait: 50 * time.Millisecond})
			}
			long := f.mw // another instance, whose duplicate waits in PostgreSQL
			orig := doAsync(origMW, doKey("evt_1"), "{}", f.heldLedgerFn("evt_1", g, nil))
			<-g.entered

			res, err := short.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
			require.ErrorIs(t, err, idem.ErrInFlight)
			assert.True(t, idem.Retryable(err))
			assert.Equal(t, time.Second, res.RetryAfter, "Options.RetryAfter's default")

			waiter := doAsync(long, doKey("evt_1"), "{}", f.ledgerFn("evt_1"))
			waitForWaitersOn(t, f, long, "evt_1", 1)
			g.open()
			o := <-orig
			require.NoError(t, o.err)
			w := <-waiter
			require.NoError(t, w.err)
			assert.True(t, w.res.Replayed)
			assert.Equal(t, o.res.Value, w.res.Value)
			assert.Equal(t, int64(1), f.runs.Load())
			assert.Equal(t, 1, f.ledgerRows())
		})
	}
	for _, where := range []string{"same instance", "another instance"} {
		t.Run("the caller gives up waiting on the "+where, func(t *testing.T) {
			t.Parallel()
			g := newGate()
			f := newFixture(t, idem.Options{LockWait: time.Hour}, nil)
			t.Cleanup(g.open)
			waiting := f.mw
			if where == "another instance" {
				waiting, _ = f.serveOn(f.db, idem.Options{LockWait: time.Hour})
			}
			orig := doAsync(f.mw, doKey("evt_1"), "{}", f.heldLedgerFn("evt_1", g, nil))
			<-g.entered
			ctx, cancel := context.WithCancel(context.Background())
			dup := make(chan error, 1)
			go func() {
				_, err := waiting.Do(ctx, doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
				dup <- err
			}()
			waitForWaitersOn(t, f, waiting, "evt_1", 1)
			cancel()
			err := <-dup
			require.ErrorIs(t, err, context.Canceled, "Do returns when its ctx ends, not after LockWait")
			assert.True(t, idem.Retryable(err))
			if where == "same instance" {
				assert.ErrorIs(t, err, idem.ErrInFlight)
			}
			g.open()
			require.NoError(t, (<-orig).err)
			assert.Equal(t, int64(1), f.runs.Load())
			assert.Equal(t, 1, f.ledgerRows())
		})
	}
	t.Run("live lease", func(t *testing.T) {
		t.Parallel()
		g := newGate()
		f := newFixture(t, idem.Options{Lease: 20 * time.Second, LockWait: time.Minute}, nil)
		t.Cleanup(g.open)
		other, _ := f.serveOn(f.db, idem.Options{Lease: 20 * time.Second, LockWait: time.Minute})
		orig := doAsync(f.mw, doKey("evt_1"), "{}", f.heldLedgerFn("evt_1", g, nil))
		<-g.entered
		res, err := other.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
		require.ErrorIs(t, err, idem.ErrInFlight, "at once, however long LockWait")
		assert.Greater(t, res.RetryAfter, 15*time.Second, "the lease's time left, not Options.RetryAfter")
		assert.LessOrEqual(t, res.RetryAfter, 20*time.Second)
		g.open()
		require.NoError(t, (<-orig).err)
		res, err = other.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
		require.NoError(t, err)
		assert.True(t, res.Replayed)
		assert.Equal(t, 1, f.ledgerRows())
	})
}

// An original that fails while a duplicate waits for it on another
// instance: the duplicate takes the key over in its transaction and runs
// fn; the original's write rolled back.
func TestDoTakesOverAFailedOriginal(t *testing.T) {
	t.Parallel()
	g := newGate()
	f := newFixture(t, idem.Options{LockWait: time.Minute}, nil)
	t.Cleanup(g.open)
	other, _ := f.serveOn(f.db, idem.Options{LockWait: time.Minute})
	orig := doAsync(f.mw, doKey("evt_1"), "{}", f.heldLedgerFn("evt_1", g, func(context.Context) error { return errBoom }))
	<-g.entered
	dup := doAsync(other, doKey("evt_1"), "{}", f.ledgerFn("evt_1"))
	waitForWaitersOn(t, f, other, "evt_1", 1)
	g.open()
	require.ErrorIs(t, (<-orig).err, errBoom)
	d := <-dup
	require.NoError(t, d.err)
	assert.False(t, d.res.Replayed, "the waiting duplicate ran fn")
	assert.Equal(t, int64(2), f.runs.Load())
	assert.Equal(t, 1, f.ledgerRows(), "the original's write rolled back")
	assert.Equal(t, 1, f.keys())
}

// Lease mode: an original whose lease ran out is fenced when it completes;
// the delivery that took the key over stored its Value.
func TestDoLeaseFencesALateOriginal(t *testing.T) {
	t.Parallel()
	g := newGate()
	f := newFixture(t, idem.Options{Lease: 20 * time.Second}, nil)
	t.Cleanup(g.open)
	var tookOver atomic.Int64
	other, _ := f.serveOn(f.db, idem.Options{Lease: 20 * time.Second, Observer: func(o idem.Observation) {
		if o.TookOver {
			tookOver.Add(1)
		}
	}})
	orig := doAsync(f.mw, doKey("evt_z"), "{}", f.heldLedgerFn("evt_z", g, nil))
	<-g.entered
	f.expireLease("evt_z")
	takeover, err := other.Do(context.Background(), doKey("evt_z"), []byte("{}"), f.ledgerFn("evt_z"))
	require.NoError(t, err)
	assert.False(t, takeover.Replayed)
	g.open()
	late := <-orig
	require.ErrorIs(t, late.err, idem.ErrLeaseExpired)
	assert.True(t, idem.Retryable(late.err))
	assert.Equal(t, idem.Result{RetryAfter: time.Second}, late.res, "no value; Options.RetryAfter to wait")
	assert.Equal(t, 1, f.ledgerRows(), "the original's write rolled back")
	res, err := f.mw.Do(context.Background(), doKey("evt_z"), []byte("{}"), f.ledgerFn("evt_z"))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, takeover.Value, res.Value)
	assert.Equal(t, int64(1), tookOver.Load())
	assert.Contains(t, f.outcomes(), idem.OutcomeFenced)
}

// Bad keys and payloads are refused before any claim: fn does not run,
// nothing is written.
func TestDoRefusesBadKeys(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{MaxBodyBytes: 64}, nil)
	for name, key := range map[string]idem.Key{
		"empty source":      {EventID: "evt_1"},
		"empty event id":    {Source: "test"},
		"event id too long": {Source: "test", EventID: strings.Repeat("e", idem.MaxKeyLen+1)},
		"source not UTF-8":  {Source: "te\xffst", EventID: "evt_1"},
		"control character": {Source: "test", EventID: "evt\n1"},
	} {
		res, err := f.mw.Do(context.Background(), key, []byte("{}"), f.ledgerFn("x"))
		assert.ErrorIs(t, err, idem.ErrInvalidKey, name)
		assert.False(t, idem.Retryable(err), name)
		assert.Zero(t, res, name)
	}
	_, err := f.mw.Do(context.Background(), doKey("evt_big"), make([]byte, 65), f.ledgerFn("evt_big"))
	assert.ErrorIs(t, err, idem.ErrBodyTooLarge)
	assert.False(t, idem.Retryable(err))
	assert.Zero(t, f.runs.Load())
	assert.Zero(t, f.keys())
	assert.Zero(t, f.ledgerRows())
	for _, o := range f.observations() {
		assert.Equal(t, idem.OutcomeRejected, o.Outcome)
	}
	_, err = f.mw.Do(context.Background(), doKey("evt_ok"), make([]byte, 64), f.ledgerFn("evt_ok"))
	assert.NoError(t, err, "a payload at the bound")
}

// What fn returns or does that cannot be stored: rolled back.
func TestDoRollsBackWhatCannotBeStored(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{MaxResponseBytes: 100}, nil)
	_, err := f.mw.Do(context.Background(), doKey("evt_big"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
		_, err := f.ledgerFn("evt_big")(ctx)
		return make([]byte, 99), err
	})
	require.ErrorIs(t, err, idem.ErrResponseTooLarge, "99 bytes and {}")
	assert.False(t, idem.Retryable(err))

	// A failed statement whose error fn swallows aborts the transaction.
	_, err = f.mw.Do(context.Background(), doKey("evt_aborted"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
		_, _ = f.ledgerFn("evt_aborted")(ctx)
		tx, _ := txFrom(ctx)
		_, _ = tx.ExecContext(ctx, `SELECT 1/0`)
		return []byte("fine, really"), nil
	})
	require.ErrorIs(t, err, idem.ErrTxAborted)
	assert.True(t, idem.Retryable(err))
	assert.Zero(t, f.ledgerRows())
	assert.Zero(t, f.keys())

	res, err := f.mw.Do(context.Background(), doKey("evt_empty"), []byte("{}"), func(context.Context) ([]byte, error) { return nil, nil })
	require.NoError(t, err)
	assert.Empty(t, res.Value)
	res, err = f.mw.Do(context.Background(), doKey("evt_empty"), []byte("{}"), f.ledgerFn("evt_empty"))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Empty(t, res.Value)
}

// N deliveries of one key at once, on two instances: fn runs once, and every
// call returns its Value.
func TestDoConcurrentDeliveriesRunOnce(t *testing.T) {
	t.Parallel()
	const n = 16
	f := newFixture(t, idem.Options{LockWait: time.Minute}, nil)
	other, _ := f.serveOn(f.db, idem.Options{LockWait: time.Minute})
	start := make(chan struct{})
	var wg sync.WaitGroup
	replies := make([]doReply, n)
	for i := range n {
		mw := f.mw
		if i%2 == 1 {
			mw = other
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			res, err := mw.Do(context.Background(), doKey("evt_hot"), []byte("{}"), f.ledgerFn("evt_hot"))
			replies[i] = doReply{res, err}
		}()
	}
	close(start)
	wg.Wait()
	ran := 0
	for _, r := range replies {
		require.NoError(t, r.err)
		assert.Equal(t, "ledger row 1", string(r.res.Value))
		if !r.res.Replayed {
			ran++
		}
	}
	assert.Equal(t, 1, ran)
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, 1, f.keys())
}

// A key completed in an older partition is replayed by Do, never run again.
func TestDoReplaysAKeyInAnOlderPartition(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	f.insertOld("evt_old", 10*day, true)
	res, err := f.mw.Do(context.Background(), doKey("evt_old"), []byte("{}"), f.ledgerFn("evt_old"))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, `{"old":"evt_old"}`, string(res.Value))
	_, err = f.mw.Do(context.Background(), doKey("evt_old"), []byte("{other}"), f.ledgerFn("evt_old"))
	assert.ErrorIs(t, err, idem.ErrPayloadMismatch)
	res, err = f.mw.Do(context.Background(), doKey("evt_new"), []byte("{}"), f.ledgerFn("evt_new"))
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	assert.NotEqual(t, f.partitionOf("evt_new"), f.partitionOf("evt_old"))
	assert.Equal(t, int64(1), f.runs.Load())
}

// A Middleware without KeyFunc serves Do; Handler on it panics at wrap time,
// naming KeyFunc.
func TestMiddlewareWithoutKeyFuncServesOnlyDo(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	mw, err := newMW(t, f.db, idem.Options{Table: f.table})
	require.NoError(t, err)
	res, err := mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
	require.NoError(t, err)
	assert.Equal(t, "ledger row 1", string(res.Value))
	defer func() {
		p := recover()
		require.NotNil(t, p, "Handler must panic without a KeyFunc")
		assert.Contains(t, fmt.Sprint(p), "KeyFunc")
	}()
	mw.Handler(http.NotFoundHandler())
}

func TestRetryableSortsTheErrors(t *testing.T) {
	for _, err := range []error{idem.ErrInFlight, idem.ErrConflict, idem.ErrUnavailable, idem.ErrHandlerTimeout,
		idem.ErrLeaseExpired, idem.ErrTxAborted, errBoom, context.Canceled, fmt.Errorf("idem: fn failed: %w", errBoom)} {
		assert.True(t, idem.Retryable(err), "%v", err)
		assert.True(t, idem.Retryable(fmt.Errorf("wrapped: %w", err)), "%v", err)
	}
	for _, err := range []error{nil, idem.ErrInvalidKey, idem.ErrNoKey, idem.ErrBodyTooLarge, idem.ErrPayloadMismatch,
		idem.ErrResponseTooLarge, idem.ErrTxMisuse, idem.ErrPartitionedIsolation} {
		assert.False(t, idem.Retryable(err), "%v", err)
	}
}

// A claim waits for a connection of the pool only as long as its context
// lasts: with the pool's one connection held elsewhere, Do returns when
// its ctx ends, not when the connection comes back (database/sql; pgx's
// pool waits within the context by itself).
func TestDoWaitsForAConnectionOnlyWhileItsContextLasts(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	table := idem.NewTestTable(t, db)
	db.SetMaxOpenConns(1)
	mw, err := idem.New(db, idem.Options{Table: table})
	require.NoError(t, err)
	run := func(context.Context) ([]byte, error) { return []byte("ran"), nil }
	_, err = mw.Do(context.Background(), idem.Key{Source: "test", EventID: "evt_first"}, []byte("x"), run) // the table's layout is known
	require.NoError(t, err)
	held, err := db.Conn(context.Background())
	require.NoError(t, err)
	returned, released := make(chan struct{}), make(chan struct{})
	go func() {
		select { // a guard only: the test fails if the connection had to come back first
		case <-returned:
		case <-time.After(20 * time.Second):
		}
		_ = held.Close()
		close(released)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = mw.Do(ctx, idem.Key{Source: "test", EventID: "evt_pool"}, []byte("x"), run)
	select {
	case <-released:
		t.Fatal("Do returned only once the pool's connection came back")
	default:
	}
	close(returned)
	<-released
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.ErrorIs(t, err, idem.ErrUnavailable)
}
