package citustest

import (
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestClaimsOnCitus runs the claim's behaviour on a table distributed by
// Citus, through the coordinator, on both adapters: a new event, its
// replay, a payload mismatch, a duplicate that waits for its original and
// replays its answer, a duplicate whose wait runs out (409), and a
// duplicate that takes over from an original whose session died.
func TestClaimsOnCitus(t *testing.T) {
	t.Parallel()
	c := citus(t, false)
	for _, adapter := range adapters {
		t.Run(adapter, func(t *testing.T) {
			ts := c.newTables(t)
			db := c.coord.db

			t.Run("a new event runs once and its duplicates replay its answer", func(t *testing.T) {
				mw := newMiddleware(t, c.coord, adapter, ts, idem.Options{})
				var runs atomic.Int32
				h := mw.Handler(ledgerHandler(ts, "coordinator", func(*http.Request) { runs.Add(1) }))
				first := serve(h, "evt_new", `{"a":1}`)
				require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
				again := serve(h, "evt_new", `{"a":1}`)
				assert.Equal(t, http.StatusCreated, again.Code)
				assert.Equal(t, "done evt_new", again.Body.String())
				// Another instance, which has no replay cache entry: the
				// answer comes from the shard.
				other := newMiddleware(t, c.coord, adapter, ts, idem.Options{})
				third := serve(other.Handler(ledgerHandler(ts, "coordinator", nil)), "evt_new", `{"a":1}`)
				assert.Equal(t, http.StatusCreated, third.Code)
				assert.Equal(t, "done evt_new", third.Body.String())
				assert.EqualValues(t, 1, runs.Load())
				assert.Equal(t, 1, ledgerRows(t, db, ts, "evt_new"))

				mismatch := serve(other.Handler(ledgerHandler(ts, "coordinator", nil)), "evt_new", `{"a":2}`)
				assert.Equal(t, http.StatusUnprocessableEntity, mismatch.Code)
				assert.Equal(t, 1, ledgerRows(t, db, ts, "evt_new"))
			})

			t.Run("a duplicate waits for its original and replays its answer", func(t *testing.T) {
				entered, release := make(chan struct{}), make(chan struct{})
				var runs atomic.Int32
				orig := newMiddleware(t, c.coord, adapter, ts, idem.Options{LockWait: 30 * time.Second})
				dup := newMiddleware(t, c.coord, adapter, ts, idem.Options{LockWait: 30 * time.Second})
				hook := func(*http.Request) {
					if runs.Add(1) == 1 {
						close(entered)
						<-release
					}
				}
				var wg sync.WaitGroup
				var origCode int
				wg.Add(1)
				go func() {
					defer wg.Done()
					origCode = serve(orig.Handler(ledgerHandler(ts, "coordinator", hook)), "evt_wait", `{}`).Code
				}()
				<-entered
				var dupRec = make(chan int, 1)
				var dupBody atomic.Value
				go func() {
					r := serve(dup.Handler(ledgerHandler(ts, "coordinator", hook)), "evt_wait", `{}`)
					dupBody.Store(r.Body.String())
					dupRec <- r.Code
				}()
				waitForClaimWaiting(t, c.coord, ts)
				close(release)
				wg.Wait()
				assert.Equal(t, http.StatusCreated, origCode)
				assert.Equal(t, http.StatusCreated, <-dupRec)
				assert.Equal(t, "done evt_wait", dupBody.Load())
				assert.EqualValues(t, 1, runs.Load())
				assert.Equal(t, 1, ledgerRows(t, db, ts, "evt_wait"))
			})

			t.Run("a duplicate whose wait runs out is answered 409", func(t *testing.T) {
				entered, release := make(chan struct{}), make(chan struct{})
				orig := newMiddleware(t, c.coord, adapter, ts, idem.Options{})
				dup := newMiddleware(t, c.coord, adapter, ts, idem.Options{LockWait: 200 * time.Millisecond})
				done := make(chan int, 1)
				go func() {
					done <- serve(orig.Handler(ledgerHandler(ts, "coordinator", func(*http.Request) {
						close(entered)
						<-release
					})), "evt_busy", `{}`).Code
				}()
				<-entered
				r := serve(dup.Handler(ledgerHandler(ts, "coordinator", nil)), "evt_busy", `{}`)
				close(release)
				assert.Equal(t, http.StatusConflict, r.Code, r.Body.String())
				assert.NotEmpty(t, r.Header().Get("Retry-After"))
				assert.Equal(t, http.StatusCreated, <-done)
				assert.Equal(t, 1, ledgerRows(t, db, ts, "evt_busy"))
			})

			t.Run("a duplicate takes over from an original whose session died", func(t *testing.T) {
				entered, release := make(chan struct{}), make(chan struct{})
				var pid atomic.Int64
				var runs atomic.Int32
				hook := func(r *http.Request) {
					if runs.Add(1) == 1 {
						p, err := queryPID(r)
						if err == nil {
							pid.Store(int64(p))
						}
						close(entered)
						<-release
					}
				}
				orig := newMiddleware(t, c.coord, adapter, ts, idem.Options{LockWait: 30 * time.Second})
				dup := newMiddleware(t, c.coord, adapter, ts, idem.Options{LockWait: 30 * time.Second})
				origDone := make(chan int, 1)
				go func() {
					origDone <- serve(orig.Handler(ledgerHandler(ts, "coordinator", hook)), "evt_dead", `{}`).Code
				}()
				<-entered
				require.NotZero(t, pid.Load())
				dupDone := make(chan int, 1)
				go func() {
					dupDone <- serve(dup.Handler(ledgerHandler(ts, "coordinator", hook)), "evt_dead", `{}`).Code
				}()
				waitForClaimWaiting(t, c.coord, ts)
				_, err := db.Exec(`SELECT pg_terminate_backend($1::int)`, pid.Load())
				assert.NoError(t, err)
				if err != nil {
					close(release)
					t.FailNow()
				}
				assert.Equal(t, http.StatusCreated, <-dupDone, "the duplicate claims the key its original lost")
				close(release)
				assert.GreaterOrEqual(t, <-origDone, 500, "the original's transaction died with its session")
				assert.EqualValues(t, 2, runs.Load())
				assert.Equal(t, 1, ledgerRows(t, db, ts, "evt_dead"), "the original's write rolled back")
			})
		})
	}
}
