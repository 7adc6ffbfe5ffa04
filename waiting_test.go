package idem_test

import (
	"database/sql"
	"fmt"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// How an original can fail while duplicates wait for it.
var originalFailures = []struct {
	name string
	fail func(w http.ResponseWriter, r *http.Request) // runs in the original's handler
}{
	{"answers a status that is not final", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "downstream blip", http.StatusServiceUnavailable)
	}},
	{"panics", func(http.ResponseWriter, *http.Request) { panic("original blew up") }},
	{"outlives HandlerTimeout", func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		w.WriteHeader(http.StatusCreated) // too late: the answer cannot be stored
	}},
}

// TestWaitingDuplicatesOfAFailedOriginal: an original fails while 1, 5 or
// 20 duplicates wait for it, with a LockWait long enough. Exactly one
// waiter takes the key over and runs the handler; every other waiter gets
// that answer replayed byte for byte; nothing is answered 409. The
// duplicates wait on the same instance as the original (in memory) or on
// another instance (one in PostgreSQL, the rest in memory).
func TestWaitingDuplicatesOfAFailedOriginal(t *testing.T) {
	t.Parallel()
	for _, failure := range originalFailures {
		for _, where := range []string{"same instance", "another instance"} {
			for _, n := range []int{1, 5, 20} {
				t.Run(fmt.Sprintf("original %s, %d duplicates waiting on the %s", failure.name, n, where), func(t *testing.T) {
					t.Parallel()
					testWaitersOfFailedOriginal(t, failure.fail, where == "another instance", n)
				})
			}
		}
	}
}

func testWaitersOfFailedOriginal(t *testing.T, fail func(http.ResponseWriter, *http.Request), remote bool, n int) {
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.hold() {
			fail(w, r)
			return
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	// The original runs behind an instance of its own, with a short
	// HandlerTimeout (only the original that outlives it comes near it);
	// its duplicates on the same instance or on f's. A takeover on the
	// original's instance has the same HandlerTimeout: 3s, so that 18
	// parallel cases under -race on partitioned tables (each claim a
	// transaction of three statements), beside the test command's other
	// passes, never bring it near either (1s did, once in CI).
	origMW, origSrv := f.serveOn(f.db, idem.Options{LockWait: time.Minute, HandlerTimeout: 3 * time.Second})
	dupMW, dupURL := origMW, origSrv.URL
	if remote {
		dupMW, dupURL = f.mw, f.srv.URL
	}
	s := newSender(t)

	orig := make(chan reply, 1)
	go func() {
		r, err := s.post(origSrv.URL, "evt_1", "{}")
		assert.NoError(t, err)
		orig <- r
	}()
	<-g.entered
	dups := make(chan reply, n)
	for i := 0; i < n; i++ {
		go func() {
			r, err := s.post(dupURL, "evt_1", "{}")
			assert.NoError(t, err)
			dups <- r
		}()
	}
	waitForWaitersOn(t, f, dupMW, "evt_1", n)
	g.open()

	o := <-orig
	assert.GreaterOrEqual(t, o.status, 500, "the original failed: %s", o.body)
	var ran, replayed []reply
	for i := 0; i < n; i++ {
		d := <-dups
		require.Equal(t, http.StatusCreated, d.status, "every waiter ends with the answer, never a 409: %s", d.body)
		if d.header.Get("Idempotent-Replayed") == "true" {
			replayed = append(replayed, d)
		} else {
			ran = append(ran, d)
		}
	}
	require.Len(t, ran, 1, "exactly one waiter took the key over")
	assert.Len(t, replayed, n-1)
	for _, d := range replayed {
		assert.Equal(t, ran[0].body, d.body, "byte for byte")
	}
	assert.Equal(t, 1, f.ledgerRows(), "one side effect")
	assert.Equal(t, 1, f.keys())
	assert.Equal(t, int64(2), f.runs.Load(), "the original and the one takeover")
	for _, o := range f.observations() {
		assert.NotEqual(t, idem.OutcomeConflict, o.Outcome, "%v", o.Err)
		assert.NotEqual(t, idem.OutcomeInFlight, o.Outcome, "%v", o.Err)
	}
}

// TestTakeoverRunsWithTheOriginalsSettings: a duplicate that waited in
// PostgreSQL for an original (lock_timeout set to LockWait for the wait)
// and then takes the key over runs the handler with the lock_timeout the
// connection had before, here set by the DSN.
func TestTakeoverRunsWithTheOriginalsSettings(t *testing.T) {
	t.Parallel()
	// A role whose sessions start with lock_timeout 7s (a role setting,
	// so that it also holds through PgBouncer, which refuses startup
	// parameters).
	role := newRole(t, idem.OpenTestDB(t), `SET lock_timeout = '7s'`)
	u, err := url.Parse(idem.TestDatabaseURL(t))
	require.NoError(t, err)
	u.User = url.User(role)
	pool := openPoolURL(t, u.String(), 4)

	g := newGate()
	f := newFixtureOn(t, pool, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.hold() {
			http.Error(w, "downstream blip", http.StatusServiceUnavailable)
			return
		}
		tx, ok := txFrom(r.Context())
		require.True(t, ok)
		var lt string
		require.NoError(t, tx.QueryRowContext(r.Context(), `SHOW lock_timeout`).Scan(&lt))
		fmt.Fprint(w, lt)
	}))
	// The original runs on a second instance, so that the duplicate waits
	// in PostgreSQL rather than in memory.
	_, otherSrv := f.serveOn(pool, idem.Options{})
	s := newSender(t)
	orig := make(chan reply, 1)
	go func() {
		r, err := s.post(otherSrv.URL, "evt_1", "{}")
		assert.NoError(t, err)
		orig <- r
	}()
	select {
	case <-g.entered:
	case r := <-orig:
		t.Fatalf("the original never reached its handler: %d %s", r.status, r.body)
	}
	dup := f.postAsync("evt_1", "{}")
	waitForWaitersOn(t, f, f.mw, "evt_1", 1) // in PostgreSQL: the original is on another instance
	g.open()
	assert.Equal(t, http.StatusServiceUnavailable, (<-orig).status)
	d := <-dup
	require.Equal(t, http.StatusOK, d.status, "%s", d.body)
	assert.Equal(t, "7s", string(d.body), "the takeover's handler sees the connection's lock_timeout, not LockWait's")
	assert.Positive(t, f.observations()[len(f.observations())-1].Wait)
}

// TestHotKeyDoesNotStarveOtherEvents: a pool of 4 connections, a slow
// original and 40 duplicates of it waiting; new events of other keys are
// served meanwhile, at their usual latency (logged), and the duplicates
// still end with the replay. With the original on this instance its
// duplicates hold no connection; with the original on another instance one
// of them waits in PostgreSQL (a quarter of the pool at most) and the rest
// in memory.
func TestHotKeyDoesNotStarveOtherEvents(t *testing.T) {
	t.Parallel()
	for _, where := range []string{"same instance", "another instance"} {
		t.Run("original on the "+where, func(t *testing.T) {
			t.Parallel()
			const dupCount, others = 40, 10
			pool := openPool(t, "", 4)
			g := newGate()
			var f *fixture
			f = newFixtureOn(t, pool, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if key, _ := idem.KeyFromContext(r.Context()); key.EventID == "hot" {
					g.hold()
				}
				f.ledgerHandler().ServeHTTP(w, r)
			}))
			origURL := f.srv.URL
			if where == "another instance" {
				_, srv := f.serveOn(openPool(t, "", 2), idem.Options{})
				origURL = srv.URL
			}
			s := newSender(t)
			orig := make(chan reply, 1)
			go func() {
				r, err := s.post(origURL, "hot", "{}")
				assert.NoError(t, err)
				orig <- r
			}()
			<-g.entered
			dups := make(chan reply, dupCount)
			for i := 0; i < dupCount; i++ {
				go func() {
					r, err := s.post(f.srv.URL, "hot", "{}")
					assert.NoError(t, err)
					dups <- r
				}()
			}
			waitForWaitersOn(t, f, f.mw, "hot", dupCount)

			// Other events, one after another, while the hot key's original
			// is held: each must be served before the original ends.
			var lat []time.Duration
			for i := 0; i < others; i++ {
				start := time.Now()
				r, err := s.post(f.srv.URL, fmt.Sprintf("cold_%d", i), "{}")
				require.NoError(t, err)
				require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
				lat = append(lat, time.Since(start))
			}
			t.Logf("%d new events of other keys served while 40 duplicates waited: latencies %v", others, lat)
			if idem.PartitionedLayout {
				idem.SummariesOf(f.mw).Wait() // a listing of the partitions in the background uses the pool too
			}
			inUse := poolInUse(t, pool)
			g.open()

			o := <-orig
			require.Equal(t, http.StatusCreated, o.status)
			for i := 0; i < dupCount; i++ {
				d := <-dups
				require.Equal(t, http.StatusCreated, d.status, "%s", d.body)
				assert.Equal(t, "true", d.header.Get("Idempotent-Replayed"))
				assert.Equal(t, o.body, d.body)
			}
			assert.Equal(t, 1+others, f.ledgerRows())
			assert.LessOrEqual(t, inUse, 1, "at most one duplicate held a connection while waiting")
		})
	}
}

// newRole creates a superuser login role with the ALTER ROLE setting
// given (e.g. "SET lock_timeout = '7s'"), dropped when t ends.
func newRole(t testing.TB, admin *sql.DB, setting string) string {
	t.Helper()
	return testdb.NewRole(t, admin, setting)
}

// openPoolURL opens a pool on dsn, capped at max connections.
func openPoolURL(t testing.TB, dsn string, max int) *sql.DB {
	t.Helper()
	db, err := idem.OpenDSN(dsn)
	require.NoError(t, err)
	db.SetMaxOpenConns(max)
	t.Cleanup(func() { db.Close() })
	return db
}
