package idem_test

// Benchmarks of the middleware beside the same work written by hand.
//
// Against real PostgreSQL (the test binary's own database, see
// testdb_test.go), with 16 concurrent senders and a pool of 8 connections:
//
//	BenchmarkNewEvent/impl={idem,idem-nocache,inline,bare}
//	BenchmarkCompletedDuplicate/impl={idem,idem-nocache,inline}
//	BenchmarkInFlightDuplicate/impl={idem,inline}
//
// "idem-nocache" is the middleware with its replay cache off: every
// duplicate asks PostgreSQL, as a duplicate of a key this instance has never
// seen does. "inline" is the seed's handler written by hand with no middleware: BEGIN;
// INSERT ... ON CONFLICT DO NOTHING RETURNING; the ledger write; the UPDATE
// that stores the answer; COMMIT (a duplicate: BEGIN; the INSERT; SELECT the
// stored answer; ROLLBACK). "bare" is the ledger write in a plain
// transaction, with no idempotency at all. Every impl runs the same ledger
// handler work: append a row, answer its id as JSON. Each benchmark reports
// stmts/op, the statements (round trips) sent per request, counted by a
// database/sql driver wrapper around pgx.
//
// Against a no-op driver that answers every statement at once, the
// middleware's own CPU and allocations, beside the same calls made inline:
//
//	BenchmarkNoopDriver/path={new,dup}/impl={idem,idem-nocache,inline,bare}
//
// scripts/bench.sh runs them with -count and compares impls with benchstat.
// The requests are served by calling ServeHTTP directly: no HTTP stack.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/internal/benchref"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
)

const (
	benchSenders  = 16   // concurrent requests, as in the targets
	benchPool     = 8    // pooled connections: pgbench's 8 clients saturate 2 cores
	benchBodySize = 1024 // bytes of JSON per request: a typical webhook
	benchDupKeys  = 1000 // completed keys the duplicate benchmarks cycle over
	benchSource   = benchref.Source
	benchHeader   = benchref.EventHeader
)

// ---- requests without an HTTP stack ----------------------------------------

// benchBody is a JSON body of about benchBodySize bytes for one event.
func benchBody(eventID string) []byte {
	head := `{"id":` + strconv.Quote(eventID) + `,"type":"payment.succeeded","pad":"`
	pad := benchBodySize - len(head) - 2
	if pad < 0 {
		pad = 0
	}
	return []byte(head + strings.Repeat("x", pad) + `"}`)
}

// benchWriter is a ResponseWriter that keeps the status and the body
// length, reusable across requests.
type benchWriter struct {
	h      http.Header
	status int
	n      int
}

func (d *benchWriter) Header() http.Header { return d.h }
func (d *benchWriter) WriteHeader(s int) {
	if d.status == 0 {
		d.status = s
	}
}
func (d *benchWriter) Write(p []byte) (int, error) {
	if d.status == 0 {
		d.status = http.StatusOK
	}
	d.n += len(p)
	return len(p), nil
}
func (d *benchWriter) reset() {
	clear(d.h)
	d.status, d.n = 0, 0
}

// benchSender sends requests to a handler, reusing its request, body reader and
// writer so that its own allocations stay out of the numbers.
type benchSender struct {
	h   http.Handler
	r   *http.Request
	br  *bytes.Reader
	w   benchWriter
	ids []string // X-Event-Id value slot
}

func newBenchSender(h http.Handler) *benchSender {
	s := &benchSender{h: h, br: bytes.NewReader(nil), w: benchWriter{h: http.Header{}}}
	// net/http's request contexts can be canceled, so database/sql watches
	// them with a goroutine per transaction; a Background context would spare
	// the inline code that cost. One context per sender, like a connection's.
	ctx, cancel := context.WithCancel(context.Background())
	runtime.SetFinalizer(s, func(*benchSender) { cancel() })
	s.r, _ = http.NewRequestWithContext(ctx, http.MethodPost, "http://bench/hook", nil)
	s.ids = []string{""}
	s.r.Header[benchHeader] = s.ids
	return s
}

// send posts body with the event id and returns the status.
func (s *benchSender) send(eventID string, body []byte) int {
	s.ids[0] = eventID
	s.br.Reset(body)
	s.r.Body = io.NopCloser(s.br)
	s.r.ContentLength = int64(len(body))
	s.w.reset()
	s.h.ServeHTTP(&s.w, s.r)
	return s.w.status
}

// ---- statement counting ----------------------------------------------------

// benchCounter counts what a pool sends: each is one round trip.
type benchCounter struct{ n atomic.Int64 }

// benchCountingConnector wraps a driver.Connector (pgx's) and counts BEGIN,
// Exec, Query, COMMIT and ROLLBACK on every connection it makes.
type benchCountingConnector struct {
	inner driver.Connector
	c     *benchCounter
}

func (cc *benchCountingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := cc.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	full, ok := conn.(benchFullConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("benchCountingConnector: %T lacks a driver interface", conn)
	}
	return &benchCountingConn{benchFullConn: full, c: cc.c}, nil
}

func (cc *benchCountingConnector) Driver() driver.Driver { return cc.inner.Driver() }

// benchFullConn is what pgx's stdlib connection implements.
type benchFullConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ExecerContext
	driver.QueryerContext
	driver.ConnPrepareContext
	driver.Pinger
	driver.SessionResetter
	driver.NamedValueChecker
}

type benchCountingConn struct {
	benchFullConn
	c *benchCounter
}

func (cc *benchCountingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	cc.c.n.Add(1)
	tx, err := cc.benchFullConn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &benchCountingTx{Tx: tx, c: cc.c}, nil
}

func (cc *benchCountingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	cc.c.n.Add(1)
	return cc.benchFullConn.ExecContext(ctx, q, args)
}

func (cc *benchCountingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	cc.c.n.Add(1)
	return cc.benchFullConn.QueryContext(ctx, q, args)
}

type benchCountingTx struct {
	driver.Tx
	c *benchCounter
}

func (t *benchCountingTx) Commit() error   { t.c.n.Add(1); return t.Tx.Commit() }
func (t *benchCountingTx) Rollback() error { t.c.n.Add(1); return t.Tx.Rollback() }

// ---- the PostgreSQL world ----------------------------------------------------

// benchWorld is one benchmark's tables and pools in the test database.
type benchWorld struct {
	db     *sql.DB
	count  *benchCounter
	table  string // idempotency table (the middleware's or the inline one's)
	ledger string
}

// openBenchPool opens a counted pool of benchPool connections on the test
// database; params are extra run-time parameters (e.g. lock_timeout).
func openBenchPool(b *testing.B, params map[string]string) (*sql.DB, *benchCounter) {
	b.Helper()
	cfg, err := pgx.ParseConfig(idem.TestDatabaseURL(b))
	if err != nil {
		b.Fatal(err)
	}
	for k, v := range params {
		cfg.RuntimeParams[k] = v
	}
	c := &benchCounter{}
	db := sql.OpenDB(&benchCountingConnector{inner: stdlib.GetConnector(*cfg), c: c})
	db.SetMaxOpenConns(benchPool)
	db.SetMaxIdleConns(benchPool) // the default of 2 would reconnect under load
	b.Cleanup(func() { db.Close() })
	if err := db.PingContext(context.Background()); err != nil {
		b.Fatalf("PostgreSQL is required: %v", err)
	}
	return db, c
}

func newBenchWorld(b *testing.B) *benchWorld {
	b.Helper()
	db, c := openBenchPool(b, nil)
	w := &benchWorld{db: db, count: c, table: idem.NewPlainTable(b, db)} // the inline SQL needs the plain table; bench_partition_test.go compares layouts
	w.ledger = "ledger_" + w.table
	if _, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (
		id bigserial PRIMARY KEY, event_id text NOT NULL, body bytea NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	return w
}

func (w *benchWorld) middleware(b *testing.B, opts idem.Options) *idem.Middleware {
	b.Helper()
	opts.KeyFunc = idem.Header(benchSource, benchHeader)
	opts.Table = w.table
	m, err := idem.New(w.db, opts)
	if err != nil {
		b.Fatal(err)
	}
	return m
}

// handler returns the impl's handler on this world.
func (w *benchWorld) handler(b *testing.B, impl string) http.Handler {
	switch impl {
	case "idem":
		return w.middleware(b, idem.Options{}).Handler(benchref.IdemHandler(w.ledger))
	case "idem-nocache":
		return w.middleware(b, idem.Options{ReplayCacheBytes: -1}).Handler(benchref.IdemHandler(w.ledger))
	case "inline":
		return benchref.InlineHandler(w.db, w.table, w.ledger)
	case "bare":
		return benchref.BareHandler(w.db, w.ledger)
	}
	b.Fatalf("unknown impl %q", impl)
	return nil
}

var benchRun atomic.Int64 // makes every benchmark run's keys unique

// benchParallel runs benchSenders goroutines, each calling do with its own
// sender until b.N requests have been sent, and reports stmts/op and req/s.
func benchParallel(b *testing.B, h http.Handler, count *benchCounter, do func(s *benchSender, i int64) int, want int) {
	b.Helper()
	b.ReportAllocs()
	// RunParallel starts parallelism x GOMAXPROCS goroutines.
	b.SetParallelism(max(1, benchSenders/runtime.GOMAXPROCS(0)))
	var (
		seq  atomic.Int64
		bad  atomic.Int64
		last atomic.Int64
	)
	if count == nil {
		count = &benchCounter{} // not counted: no stmts/op
	}
	counted := count.n.Load() == 0
	before := count.n.Load()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		s := newBenchSender(h)
		for pb.Next() {
			if st := do(s, seq.Add(1)); st != want {
				bad.Add(1)
				last.Store(int64(st))
			}
		}
	})
	b.StopTimer()
	if n := bad.Load(); n > 0 {
		b.Fatalf("%d of %d requests answered %d, want %d", n, b.N, last.Load(), want)
	}
	if n := count.n.Load() - before; n > 0 || !counted {
		b.ReportMetric(float64(n)/float64(b.N), "stmts/op")
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// BenchmarkNewEvent: every request carries a key never seen before.
func BenchmarkNewEvent(b *testing.B) {
	for _, impl := range []string{"idem", "idem-nocache", "inline", "bare"} {
		b.Run("impl="+impl, func(b *testing.B) {
			w := newBenchWorld(b)
			h := w.handler(b, impl)
			prefix := fmt.Sprintf("new-%d-", benchRun.Add(1))
			benchParallel(b, h, w.count, func(s *benchSender, i int64) int {
				id := prefix + strconv.FormatInt(i, 10)
				return s.send(id, benchBody(id))
			}, http.StatusCreated)
		})
	}
}

// BenchmarkCompletedDuplicate: every request is a redelivery of one of
// benchDupKeys completed keys, with the same body.
func BenchmarkCompletedDuplicate(b *testing.B) {
	for _, impl := range []string{"idem", "idem-nocache", "inline"} {
		b.Run("impl="+impl, func(b *testing.B) {
			w := newBenchWorld(b)
			h := w.handler(b, impl)
			ids, bodies := benchSeed(b, h, fmt.Sprintf("dup-%d-", benchRun.Add(1)), benchDupKeys)
			benchParallel(b, h, w.count, func(s *benchSender, i int64) int {
				k := i % int64(len(ids))
				return s.send(ids[k], bodies[k])
			}, http.StatusCreated)
		})
	}
}

// benchSeed completes n keys through h.
func benchSeed(b *testing.B, h http.Handler, prefix string, n int) ([]string, [][]byte) {
	b.Helper()
	ids := make([]string, n)
	bodies := make([][]byte, n)
	s := newBenchSender(h)
	for i := range ids {
		ids[i] = prefix + strconv.Itoa(i)
		bodies[i] = benchBody(ids[i])
		if st := s.send(ids[i], bodies[i]); st != http.StatusCreated {
			b.Fatalf("seeding %s: status %d", ids[i], st)
		}
	}
	return ids, bodies
}

// BenchmarkInFlightDuplicate: every request is a duplicate of a key whose
// first delivery is still running (its transaction open), answered 409
// without waiting. The middleware learns "in flight" from the advisory lock
// at once (LockWait < 0); the inline handler's INSERT waits for the row lock
// for lock_timeout = 1ms, the least PostgreSQL allows, set once per
// connection so that it costs no round trip.
func BenchmarkInFlightDuplicate(b *testing.B) {
	for _, impl := range []string{"idem", "inline"} {
		b.Run("impl="+impl, func(b *testing.B) {
			w := newBenchWorld(b)
			eventID := fmt.Sprintf("inflight-%d", benchRun.Add(1))
			body := benchBody(eventID)
			release := make(chan struct{})
			held := make(chan struct{})
			done := make(chan struct{})
			var h http.Handler
			switch impl {
			case "idem":
				m := w.middleware(b, idem.Options{LockWait: -1})
				blocking := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
					close(held)
					<-release
					rw.WriteHeader(http.StatusServiceUnavailable) // not final: rolled back
				})
				go func() {
					defer close(done)
					newBenchSender(m.Handler(blocking)).send(eventID, body)
				}()
				h = m.Handler(benchref.IdemHandler(w.ledger))
			case "inline":
				digest := sha256.Sum256(body)
				tx, err := w.db.Begin()
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tx.Exec(`INSERT INTO "`+w.table+`" (source, event_id, payload_digest) VALUES ($1, $2, $3)`,
					benchSource, eventID, digest[:]); err != nil {
					b.Fatal(err)
				}
				close(held)
				go func() {
					defer close(done)
					<-release
					_ = tx.Rollback()
				}()
				db, c := openBenchPool(b, map[string]string{"lock_timeout": "1ms"})
				w.count = c
				h = benchref.InlineHandler(db, w.table, w.ledger)
			}
			<-held
			defer func() { close(release); <-done }()
			benchParallel(b, h, w.count, func(s *benchSender, _ int64) int {
				return s.send(eventID, body)
			}, http.StatusConflict)
		})
	}
}

// ---- the no-op driver --------------------------------------------------------

// benchNoopConnector is a database/sql driver that answers every statement at
// once, as PostgreSQL would for the path it is set to: the claim is won
// (path new) or finds a completed row (path dup). It lets the benchmark
// see the middleware's own CPU and allocations, without a server.
type benchNoopConnector struct {
	dup    bool
	digest []byte // of the body the completed row was claimed with
	answer []byte
	count  benchCounter
}

func (c *benchNoopConnector) Connect(context.Context) (driver.Conn, error) {
	return &benchNoopConn{c: c}, nil
}
func (c *benchNoopConnector) Driver() driver.Driver { return benchNoopDriver{} }

type benchNoopDriver struct{}

func (benchNoopDriver) Open(string) (driver.Conn, error) {
	return nil, errors.New("noop: use the connector")
}

type benchNoopConn struct{ c *benchNoopConnector }

func (*benchNoopConn) Prepare(string) (driver.Stmt, error) {
	return nil, errors.New("noop: no prepare")
}
func (*benchNoopConn) Close() error { return nil }
func (c *benchNoopConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}
func (c *benchNoopConn) BeginTx(context.Context, driver.TxOptions) (driver.Tx, error) {
	c.c.count.n.Add(1)
	return benchNoopTx{c.c}, nil
}

func (c *benchNoopConn) ExecContext(context.Context, string, []driver.NamedValue) (driver.Result, error) {
	c.c.count.n.Add(1)
	return driver.RowsAffected(1), nil
}

var (
	benchIdemLookupCols = []string{"got", "payload_digest", "response_status", "response_headers", "response_body", "completed", "leased", "lease_left"}
	benchOneCol         = []string{"?column?"}
	benchIDCol          = []string{"id"}
	benchLookupCols     = []string{"payload_digest", "response_status", "response_body"}
	benchStoredHeaders  = []byte(`{"Content-Type": ["application/json"]}`)
)

func (c *benchNoopConn) QueryContext(_ context.Context, q string, _ []driver.NamedValue) (driver.Rows, error) {
	c.c.count.n.Add(1)
	cc := c.c
	switch {
	case strings.Contains(q, "WHERE pg_try_advisory_xact_lock"): // the middleware's claim
		if cc.dup {
			return &benchNoopRows{cols: benchOneCol}, nil // nothing inserted
		}
		return &benchNoopRows{cols: benchOneCol, row: []driver.Value{true}}, nil
	case strings.HasPrefix(q, "SELECT pg_try_advisory_xact_lock"): // the middleware's lookup
		return &benchNoopRows{cols: benchIdemLookupCols, row: []driver.Value{true, cc.digest, int64(201), benchStoredHeaders, cc.answer, true, false, int64(0)}}, nil
	case strings.HasPrefix(q, "INSERT INTO ledger"):
		return &benchNoopRows{cols: benchIDCol, row: []driver.Value{int64(42)}}, nil
	case strings.HasPrefix(q, "INSERT INTO"): // the inline claim
		if cc.dup {
			return &benchNoopRows{cols: benchOneCol}, nil
		}
		return &benchNoopRows{cols: benchOneCol, row: []driver.Value{int64(1)}}, nil
	case strings.Contains(q, "relkind = 'p'"): // the middleware's first claim: is the table partitioned, is Citus there?
		return &benchNoopRows{cols: []string{"partitioned", "citus"}, row: []driver.Value{false, false}}, nil
	case strings.HasPrefix(q, "SELECT payload_digest"): // the inline lookup
		return &benchNoopRows{cols: benchLookupCols, row: []driver.Value{cc.digest, int64(201), cc.answer}}, nil
	}
	return nil, fmt.Errorf("noop: unexpected query %.40q", q)
}

type benchNoopTx struct{ c *benchNoopConnector }

func (t benchNoopTx) Commit() error   { t.c.count.n.Add(1); return nil }
func (t benchNoopTx) Rollback() error { t.c.count.n.Add(1); return nil }

type benchNoopRows struct {
	cols []string
	row  []driver.Value // nil: no rows
	done bool
}

func (r *benchNoopRows) Columns() []string { return r.cols }
func (r *benchNoopRows) Close() error      { return nil }
func (r *benchNoopRows) Next(dest []driver.Value) error {
	if r.done || r.row == nil {
		return io.EOF
	}
	r.done = true
	copy(dest, r.row)
	return nil
}

// BenchmarkNoopDriver: one request at a time through each impl over the
// no-op driver. ns/op and allocs/op are the Go side of a request: the
// middleware (or the inline code), database/sql, and the ledger handler;
// idem minus inline is what the middleware adds over the same calls by hand.
func BenchmarkNoopDriver(b *testing.B) {
	const eventID = "evt_noop_0001"
	body := benchBody(eventID)
	digest := sha256.Sum256(body)
	for _, path := range []string{"new", "dup"} {
		for _, impl := range []string{"idem", "idem-nocache", "inline", "bare"} {
			if path == "dup" && impl == "bare" {
				continue // bare has no duplicate path
			}
			b.Run("path="+path+"/impl="+impl, func(b *testing.B) {
				c := &benchNoopConnector{dup: path == "dup", digest: digest[:], answer: benchref.Answer(42, eventID)}
				db := sql.OpenDB(c)
				db.SetMaxIdleConns(4)
				b.Cleanup(func() { db.Close() })
				var h http.Handler
				switch impl {
				case "idem", "idem-nocache":
					opts := idem.Options{KeyFunc: idem.Header(benchSource, benchHeader), Table: "ledger_keys"}
					if impl == "idem-nocache" {
						opts.ReplayCacheBytes = -1
					}
					m, err := idem.New(db, opts)
					if err != nil {
						b.Fatal(err)
					}
					h = m.Handler(benchref.IdemHandler("ledger"))
				case "inline":
					h = benchref.InlineHandler(db, "ledger_keys", "ledger")
				case "bare":
					h = benchref.BareHandler(db, "ledger")
				}
				s := newBenchSender(h)
				if st := s.send(eventID, body); st != http.StatusCreated {
					b.Fatalf("status %d", st)
				}
				// A new event needs a key never sent before (the replay cache
				// would answer it otherwise); the body stays the same.
				ids := make([]string, b.N)
				for i := range ids {
					ids[i] = eventID
					if path == "new" {
						ids[i] = "evt_noop_" + strconv.Itoa(i)
					}
				}
				b.ReportAllocs()
				before := c.count.n.Load()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					s.send(ids[i], body)
				}
				b.StopTimer()
				if s.w.status != http.StatusCreated {
					b.Fatalf("status %d", s.w.status)
				}
				b.ReportMetric(float64(c.count.n.Load()-before)/float64(b.N), "stmts/op")
			})
		}
	}
}
