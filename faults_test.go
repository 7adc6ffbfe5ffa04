package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The faults that happen in production, against real PostgreSQL: a backend
// killed mid-handler, the database going away mid-storm, a pool too small
// for the load, timeouts firing mid-transaction. Each test checks the same
// promise: what a client was told 2xx is committed exactly once, whatever
// failed was rolled back and is run again, once, by its redelivery.

func TestTerminatedBackendMidHandlerIsRolledBackAndRedeliveredOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// queryAfter: the handler uses its transaction again after the
		// kill (and answers 500 when that fails); otherwise it answers 201
		// and the middleware's store of the answer is what fails. during:
		// the backend is killed while the handler's statement runs (it
		// answers 500 when that fails). Either way the sender gets idem's
		// 503 with Retry-After: the store failed, not the handler.
		queryAfter, during bool
		lease              time.Duration
	}{
		{"the middleware's store of the answer fails", false, false, 0},
		{"the handler's next query fails", true, false, 0},
		{"the handler's statement is running", false, true, 0},
		{"lease mode, the handler's statement is running", false, true, 20 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pids, release := make(chan int), make(chan struct{})
			var f *fixture
			f = newFixture(t, idem.Options{Lease: tc.lease}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if f.runs.Load() > 1 {
					f.ledgerHandler().ServeHTTP(w, r)
					return
				}
				tx, _ := txFrom(r.Context())
				var pid int
				err := tx.QueryRowContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x') RETURNING pg_backend_pid()`).Scan(&pid)
				if !assert.NoError(t, err) {
					pid = 0
				}
				pids <- pid
				if tc.during {
					// Runs until its backend is terminated.
					if _, err := tx.ExecContext(r.Context(), `SELECT pg_sleep(60)`); err != nil {
						http.Error(w, "ledger write failed", http.StatusInternalServerError)
						return
					}
				}
				<-release
				if tc.queryAfter {
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'y')`); err != nil {
						http.Error(w, "ledger write failed", http.StatusInternalServerError)
						return
					}
				}
				w.WriteHeader(http.StatusCreated)
			}))

			first := make(chan reply)
			go func() { first <- f.post("evt_1", "{}") }()
			pid := <-pids
			require.NotZero(t, pid)
			if tc.during {
				awaitSleeping(t, f.db, pid)
			}
			terminate(t, f.db, pid)
			close(release)

			r := <-first
			assert.Equal(t, http.StatusServiceUnavailable, r.status, "body: %s", r.body)
			assert.Equal(t, "1", r.header.Get("Retry-After"))
			assertNoInternals(t, r)
			assert.Equal(t, 0, f.ledgerRows(), "the handler's write died with its backend")
			assert.Equal(t, 0, f.keys(), "nothing stored")

			again := f.post("evt_1", "{}")
			require.Equal(t, http.StatusCreated, again.status, "the redelivery runs, on a new connection: %s", again.body)
			assert.Empty(t, again.header.Get("Idempotent-Replayed"))
			dup := f.post("evt_1", "{}")
			assert.Equal(t, "true", dup.header.Get("Idempotent-Replayed"))
			assert.Equal(t, again.body, dup.body)
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, int64(2), f.runs.Load(), "the failed run and one redelivery")
		})
	}
}

// TestTerminatedBackendMidDoIsAStoreFailure: for Do, a connection that dies
// during fn's statement is idem's ErrUnavailable (retry later), not fn's
// own error, and the redelivery runs once.
func TestTerminatedBackendMidDoIsAStoreFailure(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	pids := make(chan int, 1)
	type done struct {
		res idem.Result
		err error
	}
	first := make(chan done, 1)
	go func() {
		res, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), func(ctx context.Context) ([]byte, error) {
			tx, _ := txFrom(ctx)
			var pid int
			if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				pids <- 0
				return nil, err
			}
			pids <- pid
			_, err := tx.ExecContext(ctx, `SELECT pg_sleep(60)`) // until its backend is terminated
			return nil, err
		})
		first <- done{res, err}
	}()
	pid := <-pids
	require.NotZero(t, pid)
	awaitSleeping(t, f.db, pid)
	terminate(t, f.db, pid)
	d := <-first
	require.ErrorIs(t, d.err, idem.ErrUnavailable)
	assert.True(t, idem.Retryable(d.err))
	assert.Positive(t, d.res.RetryAfter)
	assert.Equal(t, 0, f.keys())

	res, err := f.mw.Do(context.Background(), doKey("evt_1"), []byte("{}"), f.ledgerFn("evt_1"))
	require.NoError(t, err)
	assert.False(t, res.Replayed)
	assert.Equal(t, 1, f.ledgerRows())
}

// awaitSleeping waits until the backend pid runs pg_sleep.
func awaitSleeping(t *testing.T, db *sql.DB, pid int) {
	t.Helper()
	testdb.WaitFor(t, "pg_sleep to run", func() bool {
		var n int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep'`, pid).Scan(&n))
		return n == 1
	})
}

// terminate ends the backend pid and returns once it has exited.
func terminate(t *testing.T, db *sql.DB, pid int) {
	t.Helper()
	var gone bool
	// With a timeout, pg_terminate_backend returns once the backend has
	// exited (or false if it did not within the timeout).
	require.NoError(t, db.QueryRow(`SELECT pg_terminate_backend($1, 30000)`, pid).Scan(&gone))
	require.True(t, gone, "backend %d did not exit", pid)
}

// TestConnectionLossMidStormLosesAndDoublesNothing cuts the middleware's
// pool off from the database in the middle of a storm of new events and
// duplicates (see cutProxy): every open connection dies, the transactions in
// flight with them, and new connections are refused until the test has seen
// the outage turn deliveries away. Then the storm is replayed until every
// event has been answered 2xx, as senders do.
func TestConnectionLossMidStormLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	const (
		events  = 60
		copies  = 3 // deliveries of each event in the storm
		workers = 8
		refuse  = 20 // connections refused before the database comes back
	)
	proxy := startProxy(t, databaseHost(t))
	pool := openPool(t, proxy.Addr(), workers)
	var (
		f       *fixture
		cutOnce sync.Once
		trigger = "evt_20" // its first run cuts the database off mid-handler
		cutDone = make(chan struct{})
	)
	// Without the replay cache every delivery needs the database, so the
	// outage reaches duplicates of completed events too.
	f = newFixtureOn(t, pool, idem.Options{HandlerTimeout: 20 * time.Second, ReplayCacheBytes: -1}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := idem.KeyFromContext(r.Context())
		if key.EventID != trigger {
			f.ledgerHandler().ServeHTTP(w, r)
			return
		}
		cut := false
		cutOnce.Do(func() { cut = true })
		if !cut {
			f.ledgerHandler().ServeHTTP(w, r)
			return
		}
		// The ledger write and the answer are buffered in the middleware's
		// transaction and recorder: the database goes away before either is
		// committed or sent.
		f.ledgerHandler().ServeHTTP(w, r)
		proxy.Cut()
		close(cutDone)
	}))

	ids := make([]string, events)
	var deliveries []string
	for i := range ids {
		ids[i] = fmt.Sprintf("evt_%d", i)
		for c := 0; c < copies && ids[i] != trigger; c++ {
			deliveries = append(deliveries, ids[i])
		}
	}
	seed := time.Now().UnixNano()
	t.Logf("storm order seed %d", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	rng.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	// The trigger's deliveries come after a third of the storm; the rest is
	// sent once the cut has happened, so that it falls mid-storm with work
	// before and after it.
	third := len(deliveries) / 3
	deliveries = append(deliveries[:third:third], append(slices.Repeat([]string{trigger}, copies), deliveries[third:]...)...)

	s := newSender(t)
	var got replies
	var transportErrs atomic.Int64
	queue := make(chan string)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range queue {
				r, err := s.post(f.srv.URL, id, `{"event":"`+id+`"}`)
				if err != nil {
					transportErrs.Add(1)
					continue
				}
				got.add(id, r)
				if proxy.refused.Load() >= refuse {
					proxy.Restore()
				}
			}
		}()
	}
	for i, d := range deliveries {
		queue <- d
		if i == third {
			select {
			case <-cutDone:
			case <-time.After(time.Minute): // a guard against a hang, not a measurement
				close(queue)
				wg.Wait()
				t.Fatal("the trigger's first delivery never ran its handler")
			}
		}
	}
	close(queue)
	wg.Wait()
	require.Zero(t, transportErrs.Load(), "the HTTP side never failed")
	proxy.Restore() // in case the storm ended before the refusals did
	t.Logf("connections refused during the outage: %d", proxy.refused.Load())
	require.Positive(t, proxy.refused.Load(), "the outage turned connections away")

	statuses := map[int]int{}
	for _, rs := range got.m {
		for _, r := range rs {
			statuses[r.status]++
		}
	}
	t.Logf("storm answers by status: %v", statuses)
	assert.Positive(t, statuses[http.StatusServiceUnavailable], "deliveries during the outage were answered 503")
	for st := range statuses {
		// 500: a ledger write that failed mid-handler, answered by the
		// handler itself and rolled back.
		assert.Contains(t, []int{http.StatusCreated, http.StatusConflict, http.StatusInternalServerError, http.StatusServiceUnavailable}, st)
	}

	// Replay: every event until it is answered 2xx, at most 10 tries each.
	for _, id := range ids {
		for try := 0; ; try++ {
			r, err := s.post(f.srv.URL, id, `{"event":"`+id+`"}`)
			require.NoError(t, err)
			got.add(id, r)
			if r.status/100 == 2 {
				break
			}
			require.Less(t, try, 10, "event %s still answered %d after the outage: %s", id, r.status, r.body)
		}
	}
	checkExactlyOnce(t, f, ids, &got)
}

// TestSmallPoolNeverDeadlocks runs the middleware on pools of one and two
// connections. The middleware uses only the connection of its transaction:
// an original holding the last connection finishes without a second one,
// so the requests queued behind it wait for it (or time out), never for
// each other.
func TestSmallPoolNeverDeadlocks(t *testing.T) {
	t.Parallel()
	for _, size := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d connections, an original in flight and requests queued behind it", size), func(t *testing.T) {
			entered, release := make(chan struct{}), make(chan struct{})
			pool := openPool(t, "", size)
			var f *fixture
			f = newFixtureOn(t, pool, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if key, _ := idem.KeyFromContext(r.Context()); key.EventID == "evt_1" && f.runs.Load() == 1 {
					close(entered)
					<-release
				}
				f.ledgerHandler().ServeHTTP(w, r)
			}))

			orig := make(chan reply)
			go func() { orig <- f.post("evt_1", "{}") }()
			<-entered // the original holds a connection, mid-handler
			dup, other := make(chan reply), make(chan reply)
			go func() { dup <- f.post("evt_1", "{}") }()
			// The duplicate waits for the original in memory, holding no
			// connection.
			f.waitForWaiters(1)
			go func() { other <- f.post("evt_2", "{}") }()
			if size == 1 {
				// The original holds the only connection: the new event
				// waits in the pool.
				waitForPoolWaiters(t, pool, 1)
			} else {
				// The second connection is free for it: it is served while
				// the original and its duplicate are still waiting.
				o := <-other
				require.Equal(t, http.StatusCreated, o.status, "%s", o.body)
				go func() { other <- o }()
			}
			close(release)

			o := <-orig
			require.Equal(t, http.StatusCreated, o.status, "the original finished on its own connection: %s", o.body)
			d := <-dup
			assert.Equal(t, http.StatusCreated, d.status)
			assert.Equal(t, "true", d.header.Get("Idempotent-Replayed"))
			assert.Equal(t, o.body, d.body)
			assert.Equal(t, http.StatusCreated, (<-other).status)
			assert.Equal(t, 2, f.ledgerRows())
			assert.LessOrEqual(t, pool.Stats().MaxOpenConnections, size)
		})
		t.Run(fmt.Sprintf("%d connections, a storm of new events and duplicates", size), func(t *testing.T) {
			const events, copies = 20, 3
			pool := openPool(t, "", size)
			f := newFixtureOn(t, pool, idem.Options{}, nil)
			s := newSender(t)
			var got replies
			var wg sync.WaitGroup
			for i := 0; i < events; i++ {
				for c := 0; c < copies; c++ {
					wg.Add(1)
					go func(id string) {
						defer wg.Done()
						r, err := s.post(f.srv.URL, id, "{}")
						if assert.NoError(t, err) {
							got.add(id, r)
						}
					}(fmt.Sprintf("evt_%d", i))
				}
			}
			wg.Wait()
			ids := make([]string, events)
			for i := range ids {
				ids[i] = fmt.Sprintf("evt_%d", i)
				for _, r := range got.m[ids[i]] {
					// Wait (2xx), or, past LockWait or HandlerTimeout, 409/503.
					assert.Contains(t, []int{http.StatusCreated, http.StatusConflict, http.StatusServiceUnavailable}, r.status, "%s", r.body)
				}
				for try := 0; !has2xx(got.m[ids[i]]); try++ {
					require.Less(t, try, 10, "event %s never answered 2xx", ids[i])
					r, err := s.post(f.srv.URL, ids[i], "{}")
					require.NoError(t, err)
					got.add(ids[i], r)
				}
			}
			checkExactlyOnce(t, f, ids, &got)
			assert.Positive(t, poolWaits(t, pool), "requests queued for the pool's connections")
		})
	}
}

func has2xx(rs []reply) bool {
	for _, r := range rs {
		if r.status/100 == 2 {
			return true
		}
	}
	return false
}

// waitForPoolWaiters returns when n requests in all have waited for a
// connection of db.
func waitForPoolWaiters(t *testing.T, db *sql.DB, n int64) {
	t.Helper()
	waitFor(t, "requests waiting for a pooled connection", func() bool { return poolWaits(t, db) >= n })
}

// waitFor polls cond until it holds, failing the test after 30 seconds.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testdb.WaitFor(t, what, cond)
}

// statementTimeout runs a statement that statement_timeout stops.
func statementTimeout(ctx context.Context, tx testTx) error {
	_, err := tx.ExecContext(ctx, `SET LOCAL statement_timeout = '50ms'`)
	if err == nil {
		_, err = tx.ExecContext(ctx, `SELECT pg_sleep(30)`)
	}
	return err
}

// longQuery runs a statement that only ctx can stop.
func longQuery(ctx context.Context, tx testTx) error {
	_, err := tx.ExecContext(ctx, `SELECT pg_sleep(30)`)
	return err
}

// TestTimeoutsMidTransactionRollBack fires a statement_timeout and the
// middleware's HandlerTimeout while the handler's transaction has written:
// the client gets a 5xx, nothing is committed, the redelivery runs once.
func TestTimeoutsMidTransactionRollBack(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts idem.Options
		// slow runs the handler's slow statement; it returns the
		// statement's error and whether the handler reports it.
		slow    func(ctx context.Context, tx testTx) error
		report  bool
		want    int
		outcome idem.Outcome
	}{
		{
			name:    "statement_timeout fires and the handler answers 500",
			slow:    statementTimeout,
			report:  true,
			want:    http.StatusInternalServerError,
			outcome: idem.OutcomeRolledBack,
		},
		{
			name: "statement_timeout fires and the handler ignores it: the aborted transaction cannot store 201",
			slow: statementTimeout,
			// The middleware cannot store into an aborted transaction: the
			// handler answered a final status after a failed statement, its
			// mistake (ErrTxAborted), not a database outage.
			want:    http.StatusInternalServerError,
			outcome: idem.OutcomeRolledBack,
		},
		{
			name:    "HandlerTimeout fires during a query and the handler ignores it",
			opts:    idem.Options{HandlerTimeout: time.Second},
			slow:    longQuery,
			want:    http.StatusServiceUnavailable,
			outcome: idem.OutcomeRolledBack,
		},
		{
			// The handler's own answer to the deadline is replaced by the
			// timeout's: 503 with Retry-After.
			name:    "HandlerTimeout fires during a query and the handler answers 500",
			opts:    idem.Options{HandlerTimeout: time.Second},
			slow:    longQuery,
			report:  true,
			want:    http.StatusServiceUnavailable,
			outcome: idem.OutcomeRolledBack,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var f *fixture
			f = newFixture(t, tc.opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if f.runs.Load() > 1 {
					f.ledgerHandler().ServeHTTP(w, r)
					return
				}
				tx, _ := txFrom(r.Context())
				_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
				assert.NoError(t, err)
				err = tc.slow(r.Context(), tx)
				assert.Error(t, err, "the slow statement was stopped")
				if tc.report && err != nil {
					http.Error(w, "timed out", http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
			r := f.post("evt_1", "{}")
			assert.Equal(t, tc.want, r.status, "body: %s", r.body)
			if r.status == http.StatusServiceUnavailable {
				assert.Equal(t, "1", r.header.Get("Retry-After"))
			}
			if r.status >= 500 && r.header.Get("Content-Type") == "application/problem+json" {
				assertNoInternals(t, r)
			}
			assert.Equal(t, 0, f.ledgerRows(), "the write before the timeout rolled back")
			assert.Equal(t, 0, f.keys())
			assert.Equal(t, tc.outcome, f.observations()[0].Outcome, "%v", f.observations()[0].Err)

			again := f.post("evt_1", "{}")
			assert.Equal(t, http.StatusCreated, again.status, "the redelivery succeeds: %s", again.body)
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, int64(2), f.runs.Load())
		})
	}
}

// TestLockWaitHoldsWhateverTheTableSpelling runs two instances that name
// one table differently ("keys" and "public.keys", as during a rolling
// configuration change). They must agree on the key's advisory lock: else a
// duplicate on one does not learn "in flight" from the lock and blocks in
// the INSERT on the original's uncommitted row for the whole handler,
// whatever LockWait says.
func TestLockWaitHoldsWhateverTheTableSpelling(t *testing.T) {
	t.Parallel()
	entered, release := make(chan struct{}), make(chan struct{})
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: -1}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	other, err := newMW(t, f.db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: "public." + f.table, LockWait: -1})
	require.NoError(t, err)

	orig := make(chan reply)
	go func() { orig <- f.post("evt_1", "{}") }()
	<-entered
	dup := make(chan int, 1)
	go func() {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
		req.Header.Set("X-Event-Id", "evt_1")
		other.Handler(f.ledgerHandler()).ServeHTTP(rec, req)
		dup <- rec.Code
	}()
	// LockWait -1: the duplicate must answer 409 at once. It either does,
	// or it is found waiting on the original's row lock.
	var blocked bool
	waitFor(t, "the duplicate's answer or its wait", func() bool {
		select {
		case code := <-dup:
			assert.Equal(t, http.StatusConflict, code)
			return true
		default:
		}
		var n int
		require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE l.locktype = 'transactionid' AND NOT l.granted AND a.datname = current_database()`).Scan(&n))
		blocked = n > 0
		return blocked
	})
	close(release)
	<-orig
	if blocked {
		<-dup
		t.Fatal("the duplicate through \"public.<table>\" blocked on the original's row instead of answering 409 (LockWait -1)")
	}
}
