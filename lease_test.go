package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// leaseRow reads the key's lease columns: whether it is in progress, and
// whether its lease still runs.
func (f *fixture) leaseRow(source, id string) (inProgress, live bool) {
	f.t.Helper()
	err := f.db.QueryRow(`SELECT completed_at IS NULL AND lease_until IS NOT NULL, coalesce(lease_until > now(), false)
		FROM "`+f.table+`" WHERE source = $1 AND event_id = $2`, source, id).Scan(&inProgress, &live)
	if errors.Is(err, sql.ErrNoRows) {
		return false, false
	}
	require.NoError(f.t, err)
	return inProgress, live
}

// expireLease ends the key's lease now, as if its time had run out.
func (f *fixture) expireLease(id string) {
	f.t.Helper()
	res, err := f.db.Exec(`UPDATE "`+f.table+`" SET lease_until = now() - interval '1 second'
		WHERE source = 'test' AND event_id = $1 AND completed_at IS NULL AND lease_until IS NOT NULL`, id)
	require.NoError(f.t, err)
	n, err := res.RowsAffected()
	require.NoError(f.t, err)
	require.Equal(f.t, int64(1), n, "no lease to expire for %s", id)
}

// A new event in lease mode: the claim commits first, the handler's writes
// and the answer commit together afterwards; duplicates replay it, another
// body gets 422, as in single-transaction mode.
func TestLeaseModeCompletesAndReplays(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{Lease: 10 * time.Second}, nil)
	first := f.post("evt_1", `{"n":1}`)
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	again := f.post("evt_1", `{"n":1}`)
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_1", `{"n":2}`).status)
	assert.Equal(t, 1, f.ledgerRows())
	inProgress, _ := f.leaseRow("test", "evt_1")
	assert.False(t, inProgress, "completed: the lease is cleared")

	// A handler that never asks for the transaction: its answer is stored
	// on its own.
	g := newFixture(t, idem.Options{Lease: 10 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		_, _ = w.Write([]byte("queued elsewhere"))
	}))
	a := g.post("evt_2", "{}")
	b := g.post("evt_2", "{}")
	assert.Equal(t, http.StatusAccepted, a.status)
	assert.Equal(t, a.body, b.body)
	assert.Equal(t, "true", b.header.Get("Idempotent-Replayed"))
	assert.Equal(t, int64(1), g.runs.Load())
}

// New picks a HandlerTimeout shorter than the Lease when none is given, and
// takes a longer one, for handlers that keep their lease with ExtendLease,
// with a warning.
func TestLeaseOptions(t *testing.T) {
	db := idem.OpenTestDB(t)
	kf := idem.Header("test", "X-Event-Id")
	var logged strings.Builder
	logger := slog.New(slog.NewTextHandler(&logged, nil))
	_, err := idem.New(db, idem.Options{KeyFunc: kf, Lease: time.Second, HandlerTimeout: time.Minute, Logger: logger})
	assert.NoError(t, err)
	assert.Contains(t, logged.String(), "ExtendLease", "a HandlerTimeout past the lease is warned about")
	_, err = idem.New(db, idem.Options{KeyFunc: kf, Lease: -time.Second})
	assert.Error(t, err)
	_, err = idem.New(db, idem.Options{KeyFunc: kf, Lease: 5 * time.Second})
	assert.NoError(t, err, "the default HandlerTimeout is shorter than the lease")
}

// A handler that keeps its lease with ExtendLease keeps its key past the
// lease's end: a redelivery then is answered 409, not run. Once the lease
// has run out and another delivery took the key over, the heartbeat says
// so, and the original's answer is fenced. Outside a lease-mode handler
// ExtendLease refuses.
func TestExtendLeaseKeepsALongHandlersKey(t *testing.T) {
	t.Parallel()
	entered, next, beats := make(chan struct{}), make(chan struct{}), make(chan error)
	var once sync.Once
	opts := idem.Options{Lease: 20 * time.Second, HandlerTimeout: time.Minute}
	f := newFixture(t, opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		first := false
		once.Do(func() { close(entered); first = true })
		for i := 0; first && i < 2; i++ { // the original beats twice; a takeover runs at once
			<-next
			beats <- idem.ExtendLease(r.Context())
		}
		w.WriteHeader(http.StatusCreated)
	}))
	_, other := f.serveOn(f.db, opts)
	orig := f.postAsync("evt_hb", "{}")
	<-entered

	f.expireLease("evt_hb") // the lease's end, reached
	next <- struct{}{}
	require.NoError(t, <-beats, "the heartbeat of the token that owns the key")
	dup, err := newSender(t).post(other.URL, "evt_hb", "{}")
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, dup.status, "the lease runs again: %s", dup.body)

	f.expireLease("evt_hb") // no heartbeat in time: another delivery takes over
	takeover, err := newSender(t).post(other.URL, "evt_hb", "{}")
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, takeover.status, "%s", takeover.body)
	next <- struct{}{}
	assert.ErrorIs(t, <-beats, idem.ErrLeaseExpired, "the original learns it lost the key")
	late := <-orig
	assert.Equal(t, http.StatusConflict, late.status, "%s", late.body)

	assert.ErrorIs(t, idem.ExtendLease(context.Background()), idem.ErrNotLeased)
}

// Twelve handlers whose slow external call takes 1.2 s run at once on a
// pool of two connections: no connection is held while they call.
func TestLeaseHoldsNoConnectionDuringTheCall(t *testing.T) {
	t.Parallel()
	const calls = 12
	pool := openPool(t, "", 2)
	var inside, peak atomic.Int64
	all := make(chan struct{})
	var once sync.Once
	var f *fixture
	f = newFixtureOn(t, pool, idem.Options{Lease: 20 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inside.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		if n == calls {
			once.Do(func() { close(all) })
		}
		select { // every call is under way at once, or the test fails
		case <-all:
		case <-time.After(10 * time.Second):
		}
		time.Sleep(1200 * time.Millisecond) // the external call
		inside.Add(-1)
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	var wg sync.WaitGroup
	statuses := make([]int, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := newSender(t).post(f.srv.URL, "evt_"+string(rune('a'+i)), "{}")
			if assert.NoError(t, err) {
				statuses[i] = r.status
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, int64(calls), peak.Load(), "all calls overlapped")
	for i, s := range statuses {
		assert.Equal(t, http.StatusCreated, s, "call %d", i)
	}
	assert.Equal(t, calls, f.ledgerRows())
	assert.Equal(t, calls, f.keys())
}

// A duplicate while the lease lasts is answered 409 with Retry-After at
// once, from another instance, holding no connection; a status that is
// not final, a panic or HandlerTimeout releases the key at once, so the
// redelivery runs without waiting for the lease.
func TestLeaseDuplicatesAndReleases(t *testing.T) {
	t.Parallel()
	g := newGate()
	var mode atomic.Value // what the first run does
	var f *fixture
	f = newFixture(t, idem.Options{Lease: 4 * time.Second, HandlerTimeout: time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch mode.Load() {
		case "hold":
			g.hold()
			mode.Store("")
		case "503":
			mode.Store("")
			http.Error(w, "try later", http.StatusServiceUnavailable)
			return
		case "panic":
			mode.Store("")
			panic("boom")
		case "timeout":
			mode.Store("")
			<-r.Context().Done()
			return
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	_, otherSrv := f.serveOn(f.db, idem.Options{Lease: 4 * time.Second, HandlerTimeout: time.Second})
	s := newSender(t)

	mode.Store("hold")
	t.Cleanup(g.open)
	orig := f.startOriginal(g, "evt_live", "{}")
	inProgress, live := f.leaseRow("test", "evt_live")
	assert.True(t, inProgress && live, "the claim committed before the handler finished")
	dup, err := s.post(otherSrv.URL, "evt_live", "{}")
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, dup.status)
	assert.Contains(t, []string{"3", "4"}, dup.header.Get("Retry-After"), "the lease's time left, rounded up")
	g.open()
	assert.Equal(t, http.StatusCreated, (<-orig).status)

	// On the other instance, whose server recovers panics as a router does.
	for _, m := range []string{"503", "panic", "timeout"} {
		mode.Store(m)
		id := "evt_" + m
		first, err := s.post(otherSrv.URL, id, "{}")
		require.NoError(t, err)
		assert.NotEqual(t, http.StatusCreated, first.status, m)
		inProgress, _ := f.leaseRow("test", id)
		assert.False(t, inProgress, "%s: the key is released", m)
		again, err := s.post(otherSrv.URL, id, "{}")
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, again.status, "%s: the redelivery runs at once: %s", m, again.body)
	}
	assert.Equal(t, 4, f.ledgerRows())
}

// A duplicate of a key whose original died mid-handler, while its lease
// still runs, is told the truth: retry when the lease runs out. Retry-After
// is the lease's time left, read by the claim's own statements, in whole
// seconds rounded up, at least Options.RetryAfter and at most a minute.
func TestLeaseRetryAfterIsTheTimeLeft(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{Lease: 10 * time.Minute, RetryAfter: 20 * time.Second}, nil)
	for _, tc := range []struct {
		id     string
		left   time.Duration
		lo, hi int
	}{
		{"evt_45s", 45 * time.Second, 40, 45},
		{"evt_5m", 5 * time.Minute, 60, 60}, // at most a minute
		{"evt_8s", 8 * time.Second, 20, 20}, // at least RetryAfter
		{"evt_59s", 59*time.Second + 500*time.Millisecond, 55, 60},
	} {
		// The row of an original that claimed the key in lease mode and
		// died: in progress, its lease running, its token its own.
		_, err := f.db.Exec(`INSERT INTO "`+f.table+`" (source, event_id, payload_digest, lease_until, lease_token)
			VALUES ('test', $1, sha256('{}'::bytea), now() + $2 * interval '1 microsecond', 42)`, tc.id, tc.left.Microseconds())
		require.NoError(t, err)
		dup := f.post(tc.id, "{}")
		require.Equal(t, http.StatusConflict, dup.status, "%s: %s", tc.id, dup.body)
		retry, err := strconv.Atoi(dup.header.Get("Retry-After"))
		require.NoError(t, err, "%s: Retry-After %q", tc.id, dup.header.Get("Retry-After"))
		assert.GreaterOrEqual(t, retry, tc.lo, tc.id)
		assert.LessOrEqual(t, retry, tc.hi, tc.id)
		inProgress, live := f.leaseRow("test", tc.id)
		assert.True(t, inProgress && live, "%s: the dead original's lease is left to run out", tc.id)
	}
	assert.Zero(t, f.runs.Load(), "no duplicate ran the handler")
}

// An original whose lease ran out is fenced: the delivery that took the key
// over stores its answer, and the original's writes and answer roll back;
// its client gets 409, never a 2xx that differs from the stored one.
func TestLeaseFencesALateOriginal(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{Lease: 20 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := txFrom(r.Context())
		assert.True(t, ok)
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_z', 'original')`)
		assert.NoError(t, err)
		g.hold()
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("answer of the run on " + r.Host))
	}))
	t.Cleanup(g.open)
	var tookOver atomic.Int64
	_, otherSrv := f.serveOn(f.db, idem.Options{Lease: 20 * time.Second, Observer: func(o idem.Observation) {
		if o.TookOver {
			tookOver.Add(1)
		}
	}})
	orig := f.startOriginal(g, "evt_z", "{}")
	f.expireLease("evt_z")
	// The delivery that takes over comes to another instance: on the
	// original's own, it would wait in memory for the original.
	takeover, err := newSender(t).post(otherSrv.URL, "evt_z", "{}")
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, takeover.status, "%s", takeover.body)
	g.open()
	late := <-orig
	assert.Equal(t, http.StatusConflict, late.status, "%s", late.body)
	assert.Contains(t, problemDoc(t, late)["type"], "#lease-expired")
	assert.Equal(t, 1, f.ledgerRows(), "the original's write rolled back")
	replay := f.post("evt_z", "{}")
	assert.Equal(t, takeover.body, replay.body)
	var fenced int
	for _, o := range f.observations() {
		if o.Outcome == idem.OutcomeFenced {
			fenced++
			assert.ErrorIs(t, o.Err, idem.ErrLeaseExpired)
		}
	}
	assert.Equal(t, 1, fenced, "the original's instance saw its completion fenced")
	assert.Equal(t, int64(1), tookOver.Load(), "the other instance saw its takeover")
}

// Single-transaction and lease-mode instances share one table: a
// single-transaction delivery that meets a live lease answers 409; once the
// lease has run out it takes the key over, and the lease's original is
// fenced.
func TestSingleTransactionModeMeetsLeases(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{Lease: 20 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.heldLedgerHandler(g).ServeHTTP(w, r)
	}))
	_, single := f.serveOn(f.db, idem.Options{LockWait: -1})
	t.Cleanup(g.open)
	orig := f.startOriginal(g, "evt_m", "{}")
	s := newSender(t)
	r, err := s.post(single.URL, "evt_m", "{}")
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, r.status, "a live lease: in flight")

	f.expireLease("evt_m")
	r, err = s.post(single.URL, "evt_m", "{}")
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, r.status, "an expired lease is taken over: %s", r.body)
	g.open()
	assert.Equal(t, http.StatusConflict, (<-orig).status, "the lease's original is fenced")
	assert.Equal(t, 1, f.ledgerRows())
	again := f.post("evt_m", "{}")
	assert.Equal(t, r.body, again.body)
}

// Migrate adds the lease columns to a table made before lease mode, in
// place, keeping its rows; lease mode then works on it.
func TestMigrateAddsLeaseColumnsInPlace(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	old := idem.NewTestTable(t, db) + "_before_leases" // a name of this test's own
	_, err := db.Exec(`CREATE TABLE ` + old + ` (
		source text NOT NULL, event_id text NOT NULL, payload_digest bytea NOT NULL,
		response_status smallint, response_headers jsonb, response_body bytea,
		claimed_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz,
		PRIMARY KEY (source, event_id))`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO ` + old + ` VALUES ('test', 'evt_old', '\x00', 200, '{}', 'kept', now(), now())`)
	require.NoError(t, err)
	require.NoError(t, idem.Migrate(context.Background(), db, old))
	var cols, rows int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = $1 AND column_name IN ('lease_until', 'lease_token')`, old).Scan(&cols))
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+old+` WHERE response_body = 'kept'`).Scan(&rows))
	assert.Equal(t, 2, cols)
	assert.Equal(t, 1, rows)
}

// The fence is the token, not the answer: an original whose lease ran out
// is fenced even while the delivery that took over is still running, and
// the takeover then stores its own answer.
func TestLeaseFenceHoldsWhileTheTakeoverRuns(t *testing.T) {
	t.Parallel()
	first, second := newGate(), newGate()
	t.Cleanup(first.open)
	t.Cleanup(second.open)
	var runs atomic.Int64
	var f *fixture
	f = newFixture(t, idem.Options{Lease: 20 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch runs.Add(1) {
		case 1:
			first.hold()
		case 2:
			second.hold()
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	_, otherSrv := f.serveOn(f.db, idem.Options{Lease: 20 * time.Second})
	orig := f.startOriginal(first, "evt_f", "{}")
	f.expireLease("evt_f")
	takeover := make(chan reply, 1)
	go func() {
		r, err := newSender(t).post(otherSrv.URL, "evt_f", "{}")
		assert.NoError(t, err)
		takeover <- r
	}()
	<-second.entered
	first.open()
	late := <-orig
	assert.Equal(t, http.StatusConflict, late.status, "fenced while the takeover runs: %s", late.body)
	second.open()
	won := <-takeover
	require.Equal(t, http.StatusCreated, won.status, "%s", won.body)
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, won.body, f.post("evt_f", "{}").body)
}

// Operations know leases: Check tells live leases from expired ones (a
// crashed original: a warning), Stats counts them, and the sweep never
// deletes a live lease, however old its key. (A plain table: a partitioned
// one's sweep drops whole partitions, and a live lease is never in one old
// enough, its claimed_at being its claim's time.)
func TestOperationsKnowLeases(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	table := idem.NewPlainTable(t, db)
	ctx := context.Background()
	_, err := db.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, claimed_at, lease_until, lease_token) VALUES
		('test', 'live_old', '\x00', now() - interval '100 days', now() + interval '1 hour', 1),
		('test', 'expired_old', '\x00', now() - interval '100 days', now() - interval '1 hour', 2),
		('test', 'expired_new', '\x00', now(), now() - interval '1 second', 3)`)
	require.NoError(t, err)

	r, err := idemops.Check(ctx, db, idemops.CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.LiveLeases)
	assert.Equal(t, int64(2), r.ExpiredLeases)
	assert.Equal(t, int64(0), r.Unanswered, "a lease is not a key committed without an answer")
	var checks []string
	for _, f := range r.Findings {
		checks = append(checks, f.Check)
		if f.Check == "expired_leases" {
			assert.Equal(t, idemops.SeverityWarning, f.Severity)
		}
	}
	assert.Contains(t, checks, "expired_leases")
	assert.NotContains(t, checks, "unanswered_keys")

	s, err := idemops.Stats(ctx, db, idemops.StatsOptions{Table: table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), s.LiveLeases)
	assert.Equal(t, int64(2), s.ExpiredLeases)
	assert.Equal(t, int64(3), s.Rows)
	require.Len(t, s.Sources, 1)
	assert.Equal(t, int64(3), s.Sources[0].Leases)

	res, err := idemops.Sweep(ctx, db, idemops.SweepOptions{Table: table, Pause: -1})
	require.NoError(t, err)
	assert.Equal(t, int64(1), res.Removed, "only the old expired lease")
	var left []string
	rows, err := db.Query(`SELECT event_id FROM "` + table + `" ORDER BY event_id`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"expired_new", "live_old"}, left)
}

// A lease-mode handler that ends its transaction itself may have committed
// its writes: the key is kept as a claim without an answer (409 to every
// redelivery, reported by check), never released to run again.
func TestLeaseHandlerEndingItsTransactionKeepsTheKey(t *testing.T) {
	t.Parallel()
	handlerEndingItsTransactionKeepsTheKey(t, idem.Options{Lease: 10 * time.Second})
}

// In single-transaction mode too, a handler that commits the middleware's
// transaction itself (on pgx, with a raw COMMIT around the handle's
// refusal, where the key's row would only have been written with the
// answer) leaves its key claimed without an answer: never run again.
func TestHandlerCommittingItselfIsNeverRunAgain(t *testing.T) {
	t.Parallel()
	handlerEndingItsTransactionKeepsTheKey(t, idem.Options{})
}

// handlerEndingItsTransactionKeepsTheKey: a handler that writes and then
// commits the middleware's transaction itself (the *sql.Tx's Commit, or a
// raw COMMIT around idempgx's refusing handle) is answered 500, and its key
// is kept claimed without an answer: 409 to the redelivery, which does not
// run, and reported by check.
func handlerEndingItsTransactionKeepsTheKey(t *testing.T, opts idem.Options) {
	var f *fixture
	f = newFixture(t, opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
		assert.NoError(t, err)
		if tx.s != nil {
			assert.NoError(t, tx.s.Commit())
		} else {
			_, err = tx.p.Conn().Exec(r.Context(), "COMMIT") // around the handle's refusal
			assert.NoError(t, err)
		}
		_, _ = w.Write([]byte("ok"))
	}))
	assert.Equal(t, http.StatusInternalServerError, f.post("evt_1", "{}").status)
	assert.Equal(t, http.StatusConflict, f.post("evt_1", "{}").status, "not run again")
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, int64(1), f.runs.Load())
	r, err := idemops.Check(context.Background(), f.db, idemops.CheckOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.Unanswered, "reported for an operator")
}

// A duplicate whose claim meets the key's row locked (a completion
// committing) waits at most LockWait, then gets 409, not the 503 of its
// own HandlerTimeout.
func TestLeaseClaimWaitsForARowLockAtMostLockWait(t *testing.T) {
	t.Parallel()
	g := newGate()
	t.Cleanup(g.open)
	opts := idem.Options{Lease: 20 * time.Second, HandlerTimeout: 10 * time.Second, LockWait: 200 * time.Millisecond}
	f := newFixture(t, opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.hold()
		w.WriteHeader(http.StatusCreated)
	}))
	_, other := f.serveOn(f.db, opts)
	orig := f.startOriginal(g, "evt_l", "{}")
	ctx := context.Background()
	conn, err := f.db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	tx, err := conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `SELECT 1 FROM "`+f.table+`" WHERE event_id = 'evt_l' FOR UPDATE`)
	require.NoError(t, err)
	r, err := newSender(t).post(other.URL, "evt_l", "{}")
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, r.status, "%s", r.body)
	require.NoError(t, tx.Rollback())
	g.open()
	assert.Equal(t, http.StatusCreated, (<-orig).status)
}

// A COMMIT that outlives its request (answered 503 at HandlerTimeout, the
// COMMIT going on) stores the handler's own answer, whatever requests come
// after it: the answer's buffer is not recycled while the COMMIT reads it.
// A deferred trigger holds the COMMIT on an advisory lock the test holds
// until the other requests have been answered. Both modes.
func TestACommitOutlivingItsRequestStoresItsOwnAnswer(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 10 * time.Second} {
		t.Run("lease="+lease.String(), func(t *testing.T) {
			t.Parallel()
			want := strings.Repeat("A", 4096)
			var f *fixture
			f = newFixture(t, idem.Options{Lease: lease, HandlerTimeout: 2 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				key, _ := idem.KeyFromContext(r.Context())
				tx, ok := txFrom(r.Context())
				if !assert.True(t, ok) {
					return
				}
				_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ($1, '')`, key.EventID)
				assert.NoError(t, err)
				w.WriteHeader(http.StatusCreated)
				if key.EventID == "evt_slow" {
					_, _ = w.Write([]byte(want))
				}
			}))
			_, err := f.db.Exec(`CREATE FUNCTION slow_` + f.ledger + `() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN PERFORM pg_advisory_xact_lock(hashtext('` + f.ledger + `')); RETURN NULL; END $$;
				CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON ` + f.ledger + ` DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW WHEN (NEW.event_id = 'evt_slow') EXECUTE FUNCTION slow_` + f.ledger + `()`)
			require.NoError(t, err)
			// A transaction's lock, not a session's: behind PgBouncer a
			// session lock stays on a server connection that the request's
			// transaction may then get, and a session takes its own lock again.
			ctx := context.Background()
			gate, err := f.db.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer gate.Rollback()
			_, err = gate.ExecContext(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, f.ledger)
			require.NoError(t, err)
			first := f.post("evt_slow", "{}")
			assert.Equal(t, http.StatusServiceUnavailable, first.status, "%s", first.body)
			for i := range 20 { // their bodies and answers go through pooled buffers
				f.post(fmt.Sprintf("evt_%d", i), strings.Repeat("B", 4096))
			}
			require.NoError(t, gate.Commit())
			var stored []byte
			deadline := time.Now().Add(10 * time.Second)
			for f.db.QueryRow(`SELECT response_body FROM "`+f.table+`" WHERE event_id = 'evt_slow' AND completed_at IS NOT NULL`).Scan(&stored) != nil {
				require.True(t, time.Now().Before(deadline), "the COMMIT never completed")
				time.Sleep(20 * time.Millisecond)
			}
			assert.Equal(t, want, string(stored))
			assert.Equal(t, want, string(f.post("evt_slow", "{}").body))
		})
	}
}
