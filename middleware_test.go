package idem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Each test below is one row of the behaviour table in README.md, run
// against real PostgreSQL through HTTP.

func TestNewEventCommitsClaimWritesAndAnswerTogether(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)

	r := f.post("evt_1", `{"amount": 10}`)
	require.Equal(t, http.StatusCreated, r.status, "body: %s", r.body)
	// The answer is sent only after COMMIT: the moment it arrives, the claim,
	// the ledger write and the stored answer are visible to everyone.
	assert.Equal(t, 1, f.ledgerRows())
	var (
		status    int
		body      []byte
		completed bool
		headers   string
	)
	require.NoError(t, f.db.QueryRow(`SELECT response_status, response_body, completed_at IS NOT NULL, response_headers::text
		FROM "`+f.table+`" WHERE source = 'test' AND event_id = 'evt_1'`).Scan(&status, &body, &completed, &headers))
	assert.Equal(t, http.StatusCreated, status)
	assert.Equal(t, r.body, body)
	assert.True(t, completed)
	assert.Contains(t, headers, "application/json")
	assert.NotContains(t, headers, "X-Ledger-Id", "not on the replay allow-list")
	assert.Empty(t, r.header.Get("Idempotent-Replayed"))
	assert.Equal(t, int64(1), f.runs.Load())
}

// replayPaths runs a test with the in-memory replay cache on (duplicates
// after the first replay answered from memory) and off (every duplicate goes
// to the database).
func replayPaths(t *testing.T, test func(t *testing.T, opts idem.Options, fromMemory bool)) {
	t.Run("from memory", func(t *testing.T) { t.Parallel(); test(t, idem.Options{}, true) })
	t.Run("from the database", func(t *testing.T) {
		t.Parallel()
		test(t, idem.Options{ReplayCacheBytes: -1}, false)
	})
}

func TestCompletedDuplicateIsReplayedByteForByte(t *testing.T) {
	t.Parallel()
	replayPaths(t, func(t *testing.T, opts idem.Options, fromMemory bool) {
		opts.ReplayHeaders = []string{"X-Ledger-Id"}
		f := newFixture(t, opts, nil)

		first := f.post("evt_1", `{"amount": 10}`)
		require.Equal(t, http.StatusCreated, first.status)
		for i := 0; i < 3; i++ {
			dup := f.post("evt_1", `{"amount": 10}`)
			assert.Equal(t, first.status, dup.status)
			assert.Equal(t, first.body, dup.body, "exact bytes, whitespace and key order included")
			assert.Equal(t, "application/json", dup.header.Get("Content-Type"))
			assert.Equal(t, first.header.Get("X-Ledger-Id"), dup.header.Get("X-Ledger-Id"))
			assert.Equal(t, "true", dup.header.Get("Idempotent-Replayed"))
		}
		assert.Equal(t, int64(1), f.runs.Load(), "the handler ran once")
		assert.Equal(t, 1, f.ledgerRows())
		outcomes := []idem.Outcome{}
		for i, o := range f.observations() {
			outcomes = append(outcomes, o.Outcome)
			assert.Equal(t, fromMemory && i > 1, o.Cached, "the first replay reads the database, later ones memory")
		}
		assert.Equal(t, []idem.Outcome{idem.OutcomeCompleted, idem.OutcomeReplayed, idem.OutcomeReplayed, idem.OutcomeReplayed}, outcomes)
	})
}

func TestCompletedKeyWithDifferentBodyIs422(t *testing.T) {
	t.Parallel()
	replayPaths(t, func(t *testing.T, opts idem.Options, fromMemory bool) {
		f := newFixture(t, opts, nil)

		require.Equal(t, http.StatusCreated, f.post("evt_1", `{"amount": 10}`).status)
		require.Equal(t, "true", f.post("evt_1", `{"amount": 10}`).header.Get("Idempotent-Replayed"))
		r := f.post("evt_1", `{"amount": 99}`)
		assert.Equal(t, http.StatusUnprocessableEntity, r.status)
		doc := problemDoc(t, r)
		assert.EqualValues(t, 422, doc["status"])
		assert.Equal(t, int64(1), f.runs.Load(), "handler not run for the mismatch")
		assert.Equal(t, 1, f.ledgerRows())
		assert.Equal(t, idem.OutcomeMismatch, f.observations()[2].Outcome)
		assert.Equal(t, fromMemory, f.observations()[2].Cached, "the digest is checked on a cache hit too")
	})
}

func TestSameEventIDFromAnotherSourceIsAnotherKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{KeyFunc: func(r *http.Request, _ []byte) (idem.Key, error) {
		return idem.Key{Source: r.Header.Get("X-Source"), EventID: r.Header.Get("X-Event-Id")}, nil
	}}, nil)

	a := f.post("evt_1", `{}`, "X-Source", "alpha")
	b := f.post("evt_1", `{}`, "X-Source", "beta")
	require.Equal(t, http.StatusCreated, a.status)
	require.Equal(t, http.StatusCreated, b.status)
	assert.NotEqual(t, a.body, b.body, "beta never sees alpha's stored answer")
	assert.Empty(t, b.header.Get("Idempotent-Replayed"))
	assert.Equal(t, 2, f.ledgerRows())
}

func TestUncoveredMethodsPassThroughWithoutTransaction(t *testing.T) {
	t.Parallel()
	var sawTx []bool
	var mu sync.Mutex
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, ok := txFrom(r.Context())
		mu.Lock()
		sawTx = append(sawTx, ok)
		mu.Unlock()
		w.Header().Set("X-Method", r.Method)
		w.WriteHeader(http.StatusTeapot)
	}))
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodOptions} {
		r := f.do(m, "evt_1", "")
		assert.Equal(t, http.StatusTeapot, r.status, m)
		assert.Equal(t, m, r.header.Get("X-Method"))
	}
	assert.Equal(t, []bool{false, false, false}, sawTx)
	assert.Equal(t, 0, f.keys())
	assert.Empty(t, f.observations(), "pass-through requests are not the middleware's")
}

func TestConfiguredMethodsAreTheOnlyOnesClaimed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{Methods: []string{"put"}}, nil)
	assert.Equal(t, http.StatusInternalServerError, f.post("evt_1", "{}").status, "POST passes through: no transaction")
	assert.Equal(t, http.StatusCreated, f.do(http.MethodPut, "evt_1", "{}").status)
	assert.Equal(t, 1, f.keys())
}

func TestOversizedBodyIs413AndNothingIsClaimed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{MaxBodyBytes: 64}, nil)

	t.Run("with a Content-Length", func(t *testing.T) {
		r := f.post("evt_big", strings.Repeat("x", 65))
		assert.Equal(t, http.StatusRequestEntityTooLarge, r.status)
		problemDoc(t, r)
	})
	t.Run("chunked, without a length", func(t *testing.T) {
		req, err := http.NewRequest(http.MethodPost, f.srv.URL, io.MultiReader(strings.NewReader(strings.Repeat("y", 100))))
		require.NoError(t, err)
		req.Header.Set("X-Event-Id", "evt_chunked")
		req.ContentLength = -1 // unknown: sent chunked
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		res.Body.Close()
		assert.Equal(t, http.StatusRequestEntityTooLarge, res.StatusCode)
	})
	t.Run("exactly at the limit is fine", func(t *testing.T) {
		assert.Equal(t, http.StatusCreated, f.post("evt_ok", strings.Repeat("z", 64)).status)
	})
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 1, f.keys())
}

func TestBadKeysAre400AndNothingIsClaimed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{KeyFunc: idem.JSONField("test", "data.id")}, nil)

	cases := []struct{ name, body string }{
		{"malformed JSON", `{"data": {"id": "evt_1"`},
		{"missing field", `{"data": {}}`},
		{"empty id", `{"data": {"id": ""}}`},
		{"id over 255 bytes", `{"data": {"id": "` + strings.Repeat("a", 256) + `"}}`},
		{"invalid UTF-8", "{\"data\": {\"id\": \"evt_\xff\"}}"},
		{"a NUL character", `{"data": {"id": "evt\u0000"}}`},
		{"a control character", `{"data": {"id": "evt\u001b[31m"}}`},
		{"an object, not a string", `{"data": {"id": {"x": 1}}}`},
		{"the field twice", `{"data": {"id": "a", "id": "b"}}`},
		{"not an object", `["evt_1"]`},
		{"an empty body", ``},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := f.post("", c.body)
			assert.Equal(t, http.StatusBadRequest, r.status, "body: %s", r.body)
			doc := problemDoc(t, r)
			assert.NotEmpty(t, doc["detail"])
		})
	}
	t.Run("a custom KeyFunc's own error text is not shown", func(t *testing.T) {
		g := newFixture(t, idem.Options{KeyFunc: func(*http.Request, []byte) (idem.Key, error) {
			return idem.Key{}, errors.New("secret internal detail")
		}}, nil)
		r := g.post("evt_1", "{}")
		assert.Equal(t, http.StatusBadRequest, r.status)
		assert.NotContains(t, string(r.body), "secret")
		assert.Equal(t, int64(0), g.runs.Load())
		assert.Equal(t, 0, g.keys())
	})
	t.Run("a key of exactly 255 bytes is fine", func(t *testing.T) {
		assert.Equal(t, http.StatusCreated, f.post("", `{"data": {"id": "`+strings.Repeat("b", 255)+`"}}`).status)
	})
	assert.Equal(t, int64(1), f.runs.Load(), "only the valid request ran")
	assert.Equal(t, 1, f.keys())
	for _, o := range f.observations()[:len(cases)] {
		assert.Equal(t, idem.OutcomeRejected, o.Outcome)
	}
}

func TestNonSuccessAnswerRollsBackClaimAndWrites(t *testing.T) {
	t.Parallel()
	fail := true
	var f *fixture
	f = newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fail {
			tx, _ := txFrom(r.Context())
			_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
			require.NoError(t, err)
			w.Header().Set("Set-Cookie", "session=leaked")
			http.Error(w, "downstream unavailable", http.StatusBadGateway)
			return
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))

	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusBadGateway, r.status, "the handler's own answer")
	assert.Equal(t, "downstream unavailable\n", string(r.body))
	assert.Equal(t, 0, f.ledgerRows(), "the handler's write rolled back")
	assert.Equal(t, 0, f.keys(), "the claim rolled back: a failure is never cached")
	assert.Equal(t, idem.OutcomeRolledBack, f.observations()[0].Outcome)

	fail = false
	r = f.post("evt_1", "{}")
	assert.Equal(t, http.StatusCreated, r.status, "the redelivery runs again")
	assert.Equal(t, 1, f.ledgerRows())
}

func TestFinalStatusDecidesWhatIsFinal(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{FinalStatus: func(s int) bool { return s < 500 }},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "permanently invalid", http.StatusBadRequest)
		}))
	first := f.post("evt_1", "{}")
	dup := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusBadRequest, dup.status)
	assert.Equal(t, first.body, dup.body)
	assert.Equal(t, "true", dup.header.Get("Idempotent-Replayed"))
	assert.Equal(t, int64(1), f.runs.Load())
}

func TestPanicPropagatesAndRollsBack(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
		require.NoError(t, err)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("half an answer"))
		panic("boom")
	})
	// A router's recoverer around the middleware sees the panic.
	var recovered any
	f.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			recovered = recover()
			http.Error(w, "recovered", http.StatusInternalServerError)
		}()
		f.mw.Handler(inner).ServeHTTP(w, r)
	})

	r := f.post("evt_1", "{}")
	assert.Equal(t, "boom", recovered)
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.Equal(t, "recovered\n", string(r.body), "nothing buffered was sent")
	assert.Equal(t, 0, f.ledgerRows())
	assert.Equal(t, 0, f.keys())
	assert.Equal(t, idem.OutcomeRolledBack, f.observations()[0].Outcome)
}

func TestHandlerEndingTheTransactionIsMisuse(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"Commit", "Rollback"} {
		t.Run("the handler calls "+end, func(t *testing.T) {
			var f *fixture
			f = newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx, _ := txFrom(r.Context())
				_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
				require.NoError(t, err)
				var err2 error
				if end == "Commit" {
					err2 = tx.Commit()
				} else {
					err2 = tx.Rollback()
				}
				if onPgx {
					// idempgx's transaction refuses, and sends nothing.
					assert.ErrorIs(t, err2, idem.ErrTxMisuse)
				} else {
					require.NoError(t, err2)
				}
				_, _ = w.Write([]byte("ok"))
			}))
			r := f.post("evt_1", "{}")
			assert.Equal(t, http.StatusInternalServerError, r.status)
			assert.NotContains(t, string(r.body), "ok")
			obs := f.observations()[0]
			assert.ErrorIs(t, obs.Err, idem.ErrTxMisuse)
			var stored int
			require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM "`+f.table+`" WHERE completed_at IS NOT NULL`).Scan(&stored))
			assert.Equal(t, 0, stored, "nothing cached")
			switch {
			case onPgx:
				// Nothing was sent: the middleware rolled everything back,
				// and the redelivery runs once.
				assert.Equal(t, 0, f.ledgerRows())
				assert.Equal(t, 0, f.keys())
				assert.Equal(t, http.StatusInternalServerError, f.post("evt_1", "{}").status, "the same handler misuses it again")
				assert.Equal(t, 0, f.ledgerRows())
			case end == "Commit":
				// The handler committed its write and an incomplete claim; the
				// middleware never runs it again (no double effect) and says so.
				assert.Equal(t, 1, f.ledgerRows())
				dup := f.post("evt_1", "{}")
				assert.Equal(t, http.StatusConflict, dup.status)
				assert.Equal(t, int64(1), f.runs.Load())
			default:
				assert.Equal(t, 0, f.ledgerRows())
				assert.Equal(t, 0, f.keys())
			}
		})
	}
}

func TestInFlightDuplicateWaitsThenReplays(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.heldLedgerHandler(g).ServeHTTP(w, r)
	}))

	orig := f.startOriginal(g, "evt_1", "{}")
	dup := f.postAsync("evt_1", "{}")
	// Wait until the duplicate is blocked on the original's lock, then let
	// the original finish.
	f.waitForWaiters(1)
	g.open()
	o, d := <-orig, <-dup
	require.Equal(t, http.StatusCreated, o.status)
	assert.Equal(t, http.StatusCreated, d.status)
	assert.Equal(t, o.body, d.body)
	assert.Equal(t, "true", d.header.Get("Idempotent-Replayed"))
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 1, f.ledgerRows())
}

func TestInFlightDuplicateGets409AfterLockWait(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: 50 * time.Millisecond, RetryAfter: 3 * time.Second},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.heldLedgerHandler(g).ServeHTTP(w, r) }))

	orig := f.startOriginal(g, "evt_1", "{}")
	d := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusConflict, d.status)
	assert.Equal(t, "3", d.header.Get("Retry-After"))
	problemDoc(t, d)
	// The duplicate gave its connection back: only the original holds one
	// (once a listing of a partitioned table's partitions in the
	// background has ended).
	if idem.PartitionedLayout {
		idem.SummariesOf(f.mw).Wait()
	}
	assert.Equal(t, 1, poolInUse(t, f.db))
	obs := f.observations()
	require.Len(t, obs, 1)
	assert.Equal(t, idem.OutcomeInFlight, obs[0].Outcome)
	assert.Positive(t, obs[0].Wait)

	g.open()
	require.Equal(t, http.StatusCreated, (<-orig).status)
	assert.Equal(t, "true", f.post("evt_1", "{}").header.Get("Idempotent-Replayed"))
	assert.Equal(t, 1, f.ledgerRows())
}

func TestNegativeLockWaitAnswers409AtOnce(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: -1}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.heldLedgerHandler(g).ServeHTTP(w, r)
	}))
	orig := f.startOriginal(g, "evt_1", "{}")
	d := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusConflict, d.status)
	assert.Zero(t, f.observations()[0].Wait)
	g.open()
	<-orig
}

func TestDuplicateOfRolledBackOriginalClaimsAnew(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.hold() {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	orig := f.startOriginal(g, "evt_1", "{}")
	dup := f.postAsync("evt_1", "{}")
	f.waitForWaiters(1)
	g.open()
	assert.Equal(t, http.StatusServiceUnavailable, (<-orig).status)
	d := <-dup
	assert.Equal(t, http.StatusCreated, d.status, "the waiting duplicate became the original")
	assert.Empty(t, d.header.Get("Idempotent-Replayed"))
	assert.Equal(t, 1, f.ledgerRows())
}

func TestInFlightDuplicateWithDifferentBodyGets422AfterTheWait(t *testing.T) {
	t.Parallel()
	g := newGate()
	var f *fixture
	f = newFixture(t, idem.Options{LockWait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.heldLedgerHandler(g).ServeHTTP(w, r)
	}))
	orig := f.startOriginal(g, "evt_1", `{"v":1}`)
	dup := f.postAsync("evt_1", `{"v":2}`)
	f.waitForWaiters(1)
	g.open()
	require.Equal(t, http.StatusCreated, (<-orig).status)
	assert.Equal(t, http.StatusUnprocessableEntity, (<-dup).status)
}

// waitForWaiters returns when n duplicates of evt_1 wait for its original
// on f.mw or in PostgreSQL.
func (f *fixture) waitForWaiters(n int) {
	f.t.Helper()
	waitForWaitersOn(f.t, f, f.mw, "evt_1", n)
}

// waitForWaitersOn returns when n duplicates of the event id wait for its
// original: in mw's memory (duplicates of an original running on the same
// instance) or in PostgreSQL, on the key's advisory lock (only this key's:
// parallel tests share the database).
func waitForWaitersOn(t testing.TB, f *fixture, mw *idem.Middleware, id string, n int) {
	t.Helper()
	lock := uint64(idem.LockID(f.table, "test", id))
	waitFor(t, fmt.Sprintf("%d duplicates of %s waiting", n, id), func() bool {
		var inDB int
		require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			  AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1`,
			int64(lock>>32), int64(lock&0xffffffff)).Scan(&inDB))
		return int64(inDB)+idem.LocalWaiters(mw) >= int64(n)
	})
}

func TestClientHangingUpDoesNotCancelTheWork(t *testing.T) {
	t.Parallel()
	g := newGate()
	done := make(chan idem.Observation, 1)
	var f *fixture
	f = newFixture(t, idem.Options{Observer: func(o idem.Observation) { done <- o }},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.heldLedgerHandler(g).ServeHTTP(w, r) }))

	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL, strings.NewReader("{}"))
	require.NoError(t, err)
	req.Header.Set("X-Event-Id", "evt_1")
	gone := make(chan error)
	go func() {
		res, err := http.DefaultClient.Do(req)
		if err == nil {
			res.Body.Close()
		}
		gone <- err
	}()
	<-g.entered
	cancel()
	require.Error(t, <-gone, "the client hung up")
	g.open()
	o := <-done
	assert.Equal(t, idem.OutcomeCompleted, o.Outcome, "%v", o.Err)
	assert.Equal(t, 1, f.ledgerRows())
	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"), "the redelivery gets the replay")
}

func TestHandlerTimeoutRollsBack(t *testing.T) {
	t.Parallel()
	slow := true
	var f *fixture
	// Long enough that a loaded machine never hits it on the fast path.
	f = newFixture(t, idem.Options{HandlerTimeout: 2 * time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
		assert.NoError(t, err)
		if slow {
			<-r.Context().Done() // the deadline is the handler's to see
		}
		_, _ = w.Write([]byte("done"))
	}))
	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusServiceUnavailable, r.status)
	assert.NotEmpty(t, r.header.Get("Retry-After"))
	assert.ErrorIs(t, f.observations()[0].Err, idem.ErrHandlerTimeout)
	assert.Equal(t, 0, f.ledgerRows())
	assert.Equal(t, 0, f.keys())

	slow = false
	assert.Equal(t, http.StatusOK, f.post("evt_1", "{}").status, "the redelivery succeeds")
	assert.Equal(t, 1, f.ledgerRows())
}

func TestResponseOverTheCapRollsBack(t *testing.T) {
	t.Parallel()
	var f *fixture
	f = newFixture(t, idem.Options{MaxResponseBytes: 10}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `INSERT INTO `+f.ledger+` (event_id, body) VALUES ('evt_1', 'x')`)
		require.NoError(t, err)
		_, err = w.Write([]byte("0123456789"))
		require.NoError(t, err)
		_, err = w.Write([]byte("!"))
		assert.ErrorIs(t, err, idem.ErrResponseTooLarge)
	}))
	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.NotContains(t, string(r.body), "0123456789")
	assert.Equal(t, 0, f.ledgerRows())
	assert.Equal(t, 0, f.keys())
}

func TestDatabaseUnreachableIs503AndHandlerNotRun(t *testing.T) {
	t.Parallel()
	db, err := idem.OpenDSN("postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	defer db.Close()
	ran := false
	mw, err := newMW(t, db, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id")})
	require.NoError(t, err)
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
	rec := httptest.NewRecorder()
	req, _ := http.NewRequest(http.MethodPost, "/", strings.NewReader("{}"))
	req.Header.Set("X-Event-Id", "evt_1")
	h.ServeHTTP(rec, req)
	assert.Equal(t, http.StatusServiceUnavailable, rec.Code)
	assert.Equal(t, "1", rec.Header().Get("Retry-After"))
	assert.False(t, ran)
	assert.NotContains(t, rec.Body.String(), "127.0.0.1", "no internal error text")
	assert.NotContains(t, rec.Body.String(), "dial")
}

func TestSerializationFailuresInTheClaimAreRetried(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		code     string
		failures int
		want     int
		runs     int64
	}{
		{"two serialization failures, then success", "40001", 2, http.StatusCreated, 1},
		{"a deadlock, then success", "40P01", 1, http.StatusCreated, 1},
		{"serialization failures every time", "40001", 100, http.StatusConflict, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, claimFirst(idem.Options{}), nil)
			// A trigger makes the real server fail the claim's INSERT with the
			// SQLSTATE under test, the first N times.
			_, err := f.db.Exec(fmt.Sprintf(`
				CREATE SEQUENCE %[1]s_tries;
				CREATE FUNCTION %[1]s_fail() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
					IF nextval('%[1]s_tries') <= %[2]d THEN
						RAISE EXCEPTION 'injected' USING ERRCODE = '%[3]s';
					END IF;
					RETURN NEW;
				END $$;
				CREATE TRIGGER fail BEFORE INSERT ON %[1]s FOR EACH ROW EXECUTE FUNCTION %[1]s_fail();`,
				f.table, tc.failures, tc.code))
			require.NoError(t, err)
			r := f.post("evt_1", "{}")
			if claimInsertsAtStore() {
				// The claim inserted nothing: the trigger fired once, when
				// the answer was stored after the handler, and failed that
				// transaction, so nothing was committed and a redelivery
				// runs again.
				assert.Equal(t, http.StatusServiceUnavailable, r.status, "body: %s", r.body)
				assert.NotEmpty(t, r.header.Get("Retry-After"))
				assert.Equal(t, int64(1), f.runs.Load())
				assert.Equal(t, 0, f.keys())
				var fired int64
				require.NoError(t, f.db.QueryRow(`SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM `+f.table+`_tries`).Scan(&fired))
				assert.Equal(t, int64(1), fired)
				return
			}
			assert.Equal(t, tc.want, r.status, "body: %s", r.body)
			assert.Equal(t, tc.runs, f.runs.Load())
			if tc.want == http.StatusConflict {
				assert.NotEmpty(t, r.header.Get("Retry-After"))
				obs := f.observations()[0]
				assert.ErrorIs(t, obs.Err, idem.ErrConflict)
				assert.Equal(t, idem.OutcomeConflict, obs.Outcome, "told apart from a 409 in flight")
				assert.Contains(t, obs.Err.Error(), "serialization", "the cause is named")
				assert.Equal(t, "Serialization failure or deadlock", problemDoc(t, r)["title"])
				assert.Equal(t, 0, f.keys())
			}
		})
	}
}

func TestStoreAndCommitFailuresDropTheBufferedAnswer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, ddl string }{
		{"storing the response fails", `
			CREATE FUNCTION %[1]s_fail() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'injected store failure'; END $$;
			CREATE TRIGGER fail BEFORE ` + storeEvent() + ` ON %[1]s FOR EACH ROW EXECUTE FUNCTION %[1]s_fail();`},
		{"COMMIT fails", `
			CREATE FUNCTION %[1]s_fail() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN RAISE EXCEPTION 'injected commit failure'; END $$;
			CREATE CONSTRAINT TRIGGER fail AFTER INSERT ON %[2]s DEFERRABLE INITIALLY DEFERRED
				FOR EACH ROW EXECUTE FUNCTION %[1]s_fail();`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, idem.Options{}, nil)
			_, err := f.db.Exec(fmt.Sprintf(tc.ddl, f.table, f.ledger))
			require.NoError(t, err)
			r := f.post("evt_1", "{}")
			assert.Equal(t, http.StatusServiceUnavailable, r.status)
			assert.NotEmpty(t, r.header.Get("Retry-After"))
			assert.NotContains(t, string(r.body), "ledger_id", "the buffered 2xx is dropped")
			assert.NotContains(t, string(r.body), "injected", "no SQL error text")
			assert.Equal(t, 0, f.ledgerRows())
			assert.Equal(t, 0, f.keys())

			_, err = f.db.Exec(fmt.Sprintf(`DROP FUNCTION %s_fail() CASCADE`, f.table))
			require.NoError(t, err)
			assert.Equal(t, http.StatusCreated, f.post("evt_1", "{}").status, "a redelivery runs again")
			assert.Equal(t, 1, f.ledgerRows())
			assert.Equal(t, int64(2), f.runs.Load())
		})
	}
}

func TestHandlerReadsTheWholeBody(t *testing.T) {
	t.Parallel()
	payload := bytes.Repeat([]byte("0123456789"), 5000)
	var got []byte
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		assert.Equal(t, int64(len(payload)), r.ContentLength)
	}))
	assert.Equal(t, http.StatusOK, f.post("evt_1", string(payload)).status)
	assert.Equal(t, payload, got)
	var isNull bool
	var n int
	require.NoError(t, f.db.QueryRow(`SELECT response_body IS NULL, coalesce(length(response_body), -1) FROM "`+f.table+`"`).Scan(&isNull, &n))
	assert.False(t, isNull, "an empty answer is stored as empty bytes, not NULL")
	assert.Zero(t, n)
}

func TestOuterHeadersSurviveAndSetCookieIsNeverReplayed(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Set-Cookie", "session=abc")
		w.Header().Set("Location", "/orders/1")
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, "accepted")
	}))
	outer := f.srv.Config.Handler
	f.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "req-1") // e.g. a request-id middleware
		outer.ServeHTTP(w, r)
	})
	first := f.post("evt_1", "{}")
	assert.Equal(t, "session=abc", first.header.Get("Set-Cookie"), "the original answer is the handler's own")
	assert.Equal(t, "req-1", first.header.Get("X-Request-Id"))
	dup := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusAccepted, dup.status)
	assert.Equal(t, "accepted", string(dup.body))
	assert.Empty(t, dup.header.Get("Set-Cookie"))
	assert.Equal(t, "/orders/1", dup.header.Get("Location"))
	assert.Equal(t, "text/plain; charset=utf-8", dup.header.Get("Content-Type"))
	assert.Equal(t, "req-1", dup.header.Get("X-Request-Id"))
}

// A handler that swallows a failed statement and answers 2xx cannot have its
// answer stored: the transaction is aborted. That is the handler's mistake
// (500), not a database outage (503).
func TestFinalAnswerAfterAFailedStatementIs500(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_, err := tx.ExecContext(r.Context(), `SELECT 1/0`)
		assert.Error(t, err)
		_, _ = w.Write([]byte("all good"))
	}))
	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.NotContains(t, string(r.body), "all good")
	obs := f.observations()[0]
	assert.ErrorIs(t, obs.Err, idem.ErrTxAborted)
	assert.Equal(t, idem.OutcomeRolledBack, obs.Outcome)
	assert.Equal(t, 0, f.keys())
}
