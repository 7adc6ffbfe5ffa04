package citustest

import (
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLeaseModeOnCitus runs lease mode on a table distributed by Citus, on
// both adapters: Citus refuses a function in an INSERT's DO UPDATE SET,
// which the lease claim of a plain table uses. A new key, its replay, a
// duplicate of a key whose lease runs (409 with the lease's time left),
// and a key whose lease ran out (a crashed original), taken over.
func TestLeaseModeOnCitus(t *testing.T) {
	t.Parallel()
	c := citus(t, false)
	for _, adapter := range adapters {
		t.Run(adapter, func(t *testing.T) {
			ts := c.newTables(t)
			db := c.coord.db
			var tookOver atomic.Int32
			mw := newMiddleware(t, c.coord, adapter, ts, idem.Options{
				Lease: time.Minute,
				Observer: func(o idem.Observation) {
					if o.TookOver {
						tookOver.Add(1)
					}
				},
			})
			var runs atomic.Int32
			h := mw.Handler(ledgerHandler(ts, "coordinator", func(*http.Request) { runs.Add(1) }))

			r := serve(h, "lease_new", `{}`)
			require.Equal(t, http.StatusCreated, r.Code, r.Body.String())
			other := newMiddleware(t, c.coord, adapter, ts, idem.Options{Lease: time.Minute})
			r = serve(other.Handler(ledgerHandler(ts, "coordinator", nil)), "lease_new", `{}`)
			assert.Equal(t, http.StatusCreated, r.Code)
			assert.Equal(t, "done lease_new", r.Body.String())
			assert.Equal(t, 1, ledgerRows(t, db, ts, "lease_new"))

			// A lease-mode original in progress elsewhere, its lease
			// running: answered 409 at once.
			_, err := db.Exec(`INSERT INTO ` + ts.idem + ` (source, event_id, payload_digest, lease_until, lease_token)
VALUES ('test', 'lease_live', sha256('{}'::bytea), now() + interval '30 seconds', 1)`)
			require.NoError(t, err)
			r = serve(h, "lease_live", `{}`)
			assert.Equal(t, http.StatusConflict, r.Code, r.Body.String())
			assert.NotEmpty(t, r.Header().Get("Retry-After"))
			assert.Equal(t, 0, ledgerRows(t, db, ts, "lease_live"))

			// A crashed original: its lease ran out without an answer.
			_, err = db.Exec(`INSERT INTO ` + ts.idem + ` (source, event_id, payload_digest, lease_until, lease_token, claimed_at)
VALUES ('test', 'lease_dead', sha256('{}'::bytea), now() - interval '1 second', 2, now() - interval '2 minutes')`)
			require.NoError(t, err)
			r = serve(h, "lease_dead", `{}`)
			assert.Equal(t, http.StatusCreated, r.Code, r.Body.String())
			assert.EqualValues(t, 1, tookOver.Load())
			assert.Equal(t, 1, ledgerRows(t, db, ts, "lease_dead"))
			var token int64
			var completed bool
			require.NoError(t, db.QueryRow(`SELECT coalesce(lease_token, 0), completed_at IS NOT NULL FROM `+ts.idem+`
WHERE source = 'test' AND event_id = 'lease_dead'`).Scan(&token, &completed))
			assert.True(t, completed)
			assert.NotEqual(t, int64(2), token, "the takeover's token fenced the crashed original out")
			assert.EqualValues(t, 2, runs.Load())
		})
	}
}
