package idem_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A rollback's failure means a lost connection, and idem's 503 replaces the
// handler's answer, only when the handler's transaction was on that
// connection. In lease mode, a handler that never used the database answers
// what it answered even when releasing its lease fails: the store failure
// is idem's own, logged, and the key's next delivery waits for the lease.
func TestLeaseReleaseFailureKeepsTheHandlersAnswer(t *testing.T) {
	t.Parallel()
	proxy := startProxy(t, databaseHost(t))
	pool := openPool(t, proxy.Addr(), 2)
	f := newFixtureOn(t, pool, idem.Options{Lease: 20 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proxy.Cut() // the database goes away: releasing the lease fails
		http.Error(w, "the order is not valid", http.StatusUnprocessableEntity)
	}))
	r := f.post("evt_1", "{}")
	proxy.Restore()
	require.Equal(t, http.StatusUnprocessableEntity, r.status, "body: %s", r.body)
	assert.Equal(t, "the order is not valid\n", string(r.body))
	assert.Empty(t, r.header.Get("Retry-After"))
	assert.Equal(t, int64(1), f.runs.Load())
}

// openRows leaves a query's rows open on the request's transaction, as a
// handler that returns early without rows.Close does: pgx then refuses the
// ROLLBACK on the live connection ("conn busy").
func openRows(ctx context.Context, tx testTx) error {
	if tx.s != nil {
		_, err := tx.s.QueryContext(ctx, `SELECT generate_series(1, 3)`) //nolint:rowserrcheck,sqlclosecheck // the point
		return err
	}
	_, err := tx.p.Query(ctx, `SELECT generate_series(1, 3)`)
	return err
}

// A handler that leaves rows open and answers 400 gets its 400 through:
// the ROLLBACK's failure is not a lost connection. Its redelivery runs.
func TestRollbackRefusedOnALiveConnectionKeepsTheHandlersAnswer(t *testing.T) {
	t.Parallel()
	var f *fixture
	f = newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if f.runs.Load() > 1 {
			f.ledgerHandler().ServeHTTP(w, r)
			return
		}
		tx, _ := txFrom(r.Context())
		if !assert.NoError(t, openRows(r.Context(), tx)) {
			return
		}
		http.Error(w, "the order is not valid", http.StatusBadRequest)
	}))
	r := f.post("evt_1", "{}")
	require.Equal(t, http.StatusBadRequest, r.status, "body: %s", r.body)
	assert.Equal(t, "the order is not valid\n", string(r.body))
	assert.Empty(t, r.header.Get("Retry-After"))
	assert.Equal(t, 0, f.keys(), "nothing stored")

	again := f.post("evt_1", "{}")
	require.Equal(t, http.StatusCreated, again.status, "the redelivery runs: %s", again.body)
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, int64(2), f.runs.Load())
}

// For Do: fn's own error comes back, not ErrUnavailable.
func TestRollbackRefusedOnALiveConnectionKeepsFnsError(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	errInvalid := errors.New("the order is not valid")
	_, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
		tx, _ := txFrom(ctx)
		if err := openRows(ctx, tx); err != nil {
			return nil, err
		}
		return nil, errInvalid
	})
	require.ErrorIs(t, err, errInvalid)
	assert.NotErrorIs(t, err, idem.ErrUnavailable)
	assert.Equal(t, 0, f.keys())

	res, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	assert.Equal(t, 1, f.ledgerRows())
}
