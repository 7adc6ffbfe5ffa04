package idemotel_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/XSAM/otelsql"
	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
	"github.com/pgidem/idem/idempgx"
)

// The tests run against PostgreSQL, in a database of their own
// (DATABASE_URL, default the local server), and fail when it is missing.
var (
	db    *sql.DB
	dbURL string
)

func TestMain(m *testing.M) {
	u, drop, err := createDatabase("idemotel_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemotel tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemotel tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemotel tests: goroutines left:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// createDatabase creates a database named prefix_<random> on the server at
// DATABASE_URL (default: the local server, postgres@127.0.0.1:5432, trust
// auth) and returns its URL and a function that drops it. A module's tests
// depend only on what its users can import, so not on the root's
// internal/testdb.
func createDatabase(prefix string) (dbURL string, drop func() error, err error) {
	server := os.Getenv("DATABASE_URL")
	if server == "" {
		server = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	u, err := url.Parse(server)
	if err != nil {
		return "", nil, err
	}
	admin, err := sql.Open("pgx", server)
	if err != nil {
		return "", nil, err
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := prefix + "_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		admin.Close()
		return "", nil, fmt.Errorf("cannot create a test database through DATABASE_URL=%s (is PostgreSQL running?): %w", server, err)
	}
	u.Path = "/" + name
	return u.String(), func() error {
		defer admin.Close()
		_, err := admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)")
		return err
	}, nil
}

var seq atomic.Int64

// adapters are the two ways to build a middleware: idem.New on
// database/sql, idempgx.New on a pgx pool (whose SQL otelpgx traces).
var adapters = []string{"database/sql", "pgx"}

// forAdapters runs test once per adapter.
func forAdapters(t *testing.T, test func(t *testing.T, adapter string)) {
	for _, a := range adapters {
		t.Run(a, func(t *testing.T) {
			t.Parallel()
			test(t, a)
		})
	}
}

// world is one test's table, ledger, providers with in-memory exporters,
// instrumentation, middleware and server (otelhttp around idem around the
// ledger handler).
type world struct {
	t       testing.TB
	adapter string
	table   string
	ledger  string
	spans   *tracetest.SpanRecorder
	tp      *sdktrace.TracerProvider
	reader  *sdkmetric.ManualReader
	tel     *idemotel.Instrumentation
	mw      *idem.Middleware
	srv     *httptest.Server
	db      *sql.DB // the database/sql middleware's pool
	runs    atomic.Int64
	// handle, when set, runs before the ledger write, in the handler.
	handle func(r *http.Request)
	// another starts another instance of the middleware on w's table, as
	// another process would, and returns its server.
	another func() (*idem.Middleware, *httptest.Server)
}

// setup is what a test changes: the middleware's options (OnPhase and
// Observer are set to the instrumentation's unless noPhases), and
// idemotel's.
type setup struct {
	opts     idem.Options
	tel      []idemotel.Option
	noPhases bool
	// otelsql: on database/sql, the middleware's pool is opened through
	// otelsql, which traces its SQL as otelpgx does pgx's.
	otelsql bool
}

func newWorld(t testing.TB, adapter string, s setup) *world {
	t.Helper()
	n := seq.Add(1)
	w := &world{t: t, adapter: adapter, table: fmt.Sprintf("keys_%d", n), ledger: fmt.Sprintf("ledger_%d", n)}
	require.NoError(t, idem.Migrate(context.Background(), db, w.table))
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (id bigserial PRIMARY KEY, event_id text NOT NULL)`)
	require.NoError(t, err)
	w.spans = tracetest.NewSpanRecorder()
	w.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(w.spans))
	w.reader = sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(w.reader))
	t.Cleanup(func() {
		_ = w.tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	w.tel, err = idemotel.New(append([]idemotel.Option{idemotel.WithTracerProvider(w.tp), idemotel.WithMeterProvider(mp)}, s.tel...)...)
	require.NoError(t, err)

	opts := s.opts
	opts.Table = w.table
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if opts.KeyFunc == nil {
		opts.KeyFunc = idem.Header("test", "X-Event-Id")
	}
	opts.Observer = idem.Observers(opts.Observer, w.tel.Observe)
	if !s.noPhases {
		opts.OnPhase = w.tel.OnPhase
	}
	w.db = db
	if s.otelsql {
		w.db, err = otelsql.Open("pgx", dbURL, otelsql.WithTracerProvider(w.tp))
		require.NoError(t, err)
		t.Cleanup(func() { _ = w.db.Close() })
	}
	w.mw, w.srv = w.instance(opts, mp)
	reg, err := w.tel.Watch(w.mw)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Unregister() })
	w.another = func() (*idem.Middleware, *httptest.Server) { return w.instance(opts, mp) }
	return w
}

// instance builds a middleware with opts on w's adapter, and a server that
// runs it (otelhttp around idem around the ledger handler).
func (w *world) instance(opts idem.Options, mp *sdkmetric.MeterProvider) (*idem.Middleware, *httptest.Server) {
	t := w.t
	var mw *idem.Middleware
	var err error
	if w.adapter == "pgx" {
		cfg, err := pgxpool.ParseConfig(dbURL)
		require.NoError(t, err)
		cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(w.tp))
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		mw, err = idempgx.New(pool, opts)
		require.NoError(t, err)
	} else {
		mw, err = idem.New(w.db, opts)
		require.NoError(t, err)
	}
	handler := mw.Handler(http.HandlerFunc(w.ledgerHandler))
	srv := httptest.NewServer(otelhttp.NewHandler(handler, "webhook",
		otelhttp.WithTracerProvider(w.tp), otelhttp.WithMeterProvider(mp)))
	t.Cleanup(srv.Close)
	return mw, srv
}

// ledgerHandler writes a ledger row in idem's transaction and answers 200.
func (w *world) ledgerHandler(rw http.ResponseWriter, r *http.Request) {
	w.runs.Add(1)
	if w.handle != nil {
		w.handle(r)
	}
	writeLedger(w.ledger)(rw, r)
}

// writeLedger is a handler that writes the event's row into ledger in
// idem's transaction, on either adapter, and answers 200.
func writeLedger(ledger string) http.HandlerFunc {
	q := `INSERT INTO ` + ledger + ` (event_id) VALUES ($1)`
	return func(rw http.ResponseWriter, r *http.Request) {
		var err error
		if tx, ok := idem.Tx(r.Context()); ok {
			_, err = tx.ExecContext(r.Context(), q, r.Header.Get("X-Event-Id"))
		} else if tx, ok := idempgx.Tx(r.Context()); ok {
			_, err = tx.Exec(r.Context(), q, r.Header.Get("X-Event-Id"))
		}
		if err != nil {
			http.Error(rw, "write failed", http.StatusInternalServerError)
			return
		}
		rw.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(rw, `{"ok":true}`)
	}
}

// holdFirst makes the handler's first run wait: entered closes when it
// starts waiting, and open lets it go on (also when the test ends).
func (w *world) holdFirst() (entered <-chan struct{}, open func()) {
	in, release := make(chan struct{}), make(chan struct{})
	var first, opened sync.Once
	w.handle = func(*http.Request) {
		held := false
		first.Do(func() { held = true })
		if held {
			close(in)
			<-release
		}
	}
	open = func() { opened.Do(func() { close(release) }) }
	w.t.Cleanup(open)
	return in, open
}

// post delivers event id with body and returns the status.
func (w *world) post(id, body string) int { return w.postTo(w.srv, id, body) }

// postTo delivers event id with body to srv and returns the status.
func (w *world) postTo(srv *httptest.Server, id, body string) int {
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(body))
	require.NoError(w.t, err)
	if id != "" {
		req.Header.Set("X-Event-Id", id)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(w.t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// postAsync delivers in the background; the status arrives on the channel.
func (w *world) postAsync(id, body string) <-chan int {
	c := make(chan int, 1)
	go func() { c <- w.post(id, body) }()
	return c
}

// ledgerRows counts the ledger's rows.
func (w *world) ledgerRows() int {
	var n int
	require.NoError(w.t, db.QueryRow(`SELECT count(*) FROM `+w.ledger).Scan(&n))
	return n
}

// ended returns the spans ended so far, and forgets them.
func (w *world) ended() spanSet {
	s := spanSet(w.spans.Ended())
	w.spans.Reset()
	return s
}

// metrics collects the metrics now.
func (w *world) metrics() metricdata.ResourceMetrics {
	var rm metricdata.ResourceMetrics
	require.NoError(w.t, w.reader.Collect(context.Background(), &rm))
	return rm
}

// leaseOver waits (a lease runs out with time, there is no event) until
// the lease of id's claim has run out.
func (w *world) leaseOver(id string) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var over bool
		err := db.QueryRow(`SELECT lease_until < now() FROM `+w.table+` WHERE event_id = $1`, id).Scan(&over)
		require.NoError(w.t, err)
		if over {
			return
		}
		require.True(w.t, time.Now().Before(deadline), "the lease of %s did not run out", id)
		time.Sleep(10 * time.Millisecond)
	}
}
