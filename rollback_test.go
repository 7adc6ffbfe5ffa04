package idem_test

import (
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
