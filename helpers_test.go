package idem_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/require"
)

// Where tests go. Each test file is named for what it checks: the claim
// (claim_test, waiting_test, storm_test), the run and COMMIT (commit_test,
// faults_test, latewrite_test), lease mode (lease_test,
// lease_process_test), partitioned tables (partition_test, summary_test),
// keys and presets (keyfunc_test, scope_test, verify_test,
// verify_e2e_test), hostile input and hardening (hostile_test,
// security_test, hardening_test), the wire (wire_test), the docs
// (readme_test, guarantees_test, surface_test) and fuzzing (fuzz_test).
// Every behaviour test builds its world with newFixture (this file), so the
// same test runs on both adapters (IDEM_ADAPTER) and layouts
// (IDEM_LAYOUT). Generic helpers (polling, roles, pools, clocks, keys
// written straight into the table) live once, in internal/testdb, shared
// with the idemops tests; the operations' own tests live in idemops. Which
// statements a claim sends, in which batches, is tested once for both
// adapters in internal/claims, against a fake Pool.

// fixture is one test's world: its own idempotency table and ledger table in
// the test database, a middleware, and a server running the ledger handler
// (or another) behind it.
type fixture struct {
	t      testing.TB
	db     *sql.DB
	table  string
	ledger string
	mw     *idem.Middleware
	srv    *httptest.Server
	inner  http.Handler // the handler behind f.mw, counting its runs
	runs   atomic.Int64 // how often the inner handler ran

	mu   sync.Mutex
	seen []idem.Observation
}

// newFixture builds the world. opts.KeyFunc defaults to the X-Event-Id
// header with source "test"; opts.Table is set to the test's own table.
// inner defaults to the ledger handler.
func newFixture(t testing.TB, opts idem.Options, inner http.Handler) *fixture {
	t.Helper()
	return newFixtureOn(t, nil, opts, inner)
}

// newFixtureOn is newFixture with the middleware on pool (nil: f.db): the
// tables, the ledger handler and every check stay on f.db, the claims go
// through pool (a small pool, or one behind a cutProxy).
func newFixtureOn(t testing.TB, pool *sql.DB, opts idem.Options, inner http.Handler) *fixture {
	t.Helper()
	return buildFixture(t, pool, opts, inner, idem.NewTestTable)
}

// newPlainFixture is newFixture on a plain table whatever IDEM_LAYOUT says:
// for the row-by-row sweep, whose tests date keys back one by one.
func newPlainFixture(t testing.TB, opts idem.Options, inner http.Handler) *fixture {
	t.Helper()
	return buildFixture(t, nil, opts, inner, idem.NewPlainTable)
}

// buildFixture is newFixtureOn with the table made by newTable.
func buildFixture(t testing.TB, pool *sql.DB, opts idem.Options, inner http.Handler, newTable func(testing.TB, *sql.DB) string) *fixture {
	t.Helper()
	f := &fixture{t: t, db: idem.OpenTestDB(t)}
	if pool == nil {
		pool = f.db
	}
	f.table = newTable(t, f.db)
	f.ledger = "ledger_" + f.table
	_, err := f.db.Exec(`CREATE TABLE ` + f.ledger + ` (
		id bigserial PRIMARY KEY, event_id text NOT NULL, body bytea NOT NULL)`)
	require.NoError(t, err)
	if opts.KeyFunc == nil {
		opts.KeyFunc = idem.Header("test", "X-Event-Id")
	}
	opts.Table = f.table
	user := opts.Observer
	opts.Observer = func(o idem.Observation) {
		f.mu.Lock()
		f.seen = append(f.seen, o)
		f.mu.Unlock()
		if user != nil {
			user(o)
		}
	}
	f.mw, err = newMW(t, pool, opts)
	require.NoError(t, err)
	if inner == nil {
		inner = f.ledgerHandler()
	}
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.runs.Add(1)
		inner.ServeHTTP(w, r)
	})
	f.inner = counted
	f.srv = httptest.NewServer(f.mw.Handler(counted))
	t.Cleanup(f.srv.Close)
	return f
}

// serveOn runs f's handler behind another middleware instance on f's table
// (opts.KeyFunc and opts.Table default to f's), as another process would.
func (f *fixture) serveOn(pool *sql.DB, opts idem.Options) (*idem.Middleware, *httptest.Server) {
	f.t.Helper()
	if opts.KeyFunc == nil {
		opts.KeyFunc = idem.Header("test", "X-Event-Id")
	}
	if opts.Table == "" {
		opts.Table = f.table
	}
	mw, err := newMW(f.t, pool, opts)
	require.NoError(f.t, err)
	srv := httptest.NewServer(recoverer(mw.Handler(f.inner)))
	f.t.Cleanup(srv.Close)
	return mw, srv
}

// recoverer answers a panic with 500, as a router's recoverer does.
func recoverer(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if recover() != nil {
				w.WriteHeader(http.StatusInternalServerError)
			}
		}()
		next.ServeHTTP(w, r)
	})
}

// ledgerHandler appends the request to the ledger inside the middleware's
// transaction and answers with the new row's id: a non-idempotent write, so
// a second run would show as a second row and a different id.
func (f *fixture) ledgerHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := txFrom(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		key, _ := idem.KeyFromContext(r.Context())
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "read body", http.StatusInternalServerError)
			return
		}
		var id int64
		err = tx.QueryRowContext(r.Context(),
			`INSERT INTO `+f.ledger+` (event_id, body) VALUES ($1, $2) RETURNING id`, key.EventID, body).Scan(&id)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Ledger-Id", fmt.Sprint(id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "{\"ledger_id\": %d,  \"event\":%q}\n", id, key.EventID)
	})
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

// post sends one delivery with the event id header (if id != "").
func (f *fixture) post(id string, body string, hdr ...string) reply {
	f.t.Helper()
	return f.do(http.MethodPost, id, body, hdr...)
}

func (f *fixture) do(method, id, body string, hdr ...string) reply {
	f.t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, f.srv.URL+"/hook", bytes.NewBufferString(body))
	require.NoError(f.t, err)
	if id != "" {
		req.Header.Set("X-Event-Id", id)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return f.send(req)
}

// send sends req and reads the whole reply.
func (f *fixture) send(req *http.Request) reply {
	f.t.Helper()
	res, err := http.DefaultClient.Do(req)
	require.NoError(f.t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(f.t, err)
	return reply{status: res.StatusCode, header: res.Header, body: b}
}

// count returns the rows of a table.
func (f *fixture) count(table string) int {
	f.t.Helper()
	var n int
	require.NoError(f.t, f.db.QueryRow(`SELECT count(*) FROM `+table).Scan(&n))
	return n
}

// keys returns the idempotency rows: committed claims.
func (f *fixture) keys() int { return f.count(`"` + f.table + `"`) }

// ledgerRows returns the ledger rows: side effects that committed.
func (f *fixture) ledgerRows() int { return f.count(f.ledger) }

// observations returns a copy of what the Observer saw.
func (f *fixture) observations() []idem.Observation {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]idem.Observation(nil), f.seen...)
}

// problem decodes an application/problem+json answer.
func problemDoc(t testing.TB, r reply) map[string]any {
	t.Helper()
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"), "body: %s", r.body)
	var doc map[string]any
	require.NoError(t, json.Unmarshal(r.body, &doc))
	return doc
}

// gate holds the first run of a handler until the test releases it, so that
// duplicates can be sent while the original is in flight.
type gate struct {
	entered, release chan struct{}
	taken            atomic.Bool
	opened           sync.Once
}

func newGate() *gate { return &gate{entered: make(chan struct{}), release: make(chan struct{})} }

// hold is called by the handler: its first call says so and waits for
// open; it reports whether it was that first call.
func (g *gate) hold() bool {
	if !g.taken.CompareAndSwap(false, true) {
		return false
	}
	close(g.entered)
	<-g.release
	return true
}

// open lets the held original go on; opening twice is fine.
func (g *gate) open() { g.opened.Do(func() { close(g.release) }) }

// heldLedgerHandler is the ledger handler whose first run waits at g.
func (f *fixture) heldLedgerHandler(g *gate) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.hold()
		f.ledgerHandler().ServeHTTP(w, r)
	})
}

// postAsync sends a delivery in the background; its reply arrives on the
// channel.
func (f *fixture) postAsync(id, body string) <-chan reply {
	c := make(chan reply, 1)
	go func() { c <- f.post(id, body) }()
	return c
}

// startOriginal sends a delivery and returns once its handler is held at g.
func (f *fixture) startOriginal(g *gate, id, body string) <-chan reply {
	c := f.postAsync(id, body)
	<-g.entered
	return c
}
