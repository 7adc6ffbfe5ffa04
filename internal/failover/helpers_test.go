// Package failover holds the tests of what idem's answers are worth when
// the PostgreSQL primary fails: a primary with a streaming standby (two
// clusters of this machine's PostgreSQL 15, started by the tests), failed
// over in the middle of a retry storm, and a primary whose synchronous
// standby is away while a COMMIT waits for it. Where the PostgreSQL server
// binaries are not installed they fail, as every test that needs
// PostgreSQL does.
package failover

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/pgcluster"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

var (
	setOnce sync.Once
	set     *pgcluster.Set
	setErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if set != nil {
		if err := set.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "failover tests: clean up the clusters:", err)
			code = 1
		}
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "failover tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// clusters returns this test binary's set of clusters (one initdb, copied
// for each cluster). Where PostgreSQL's server binaries are not installed
// the test fails, as every test that needs PostgreSQL does.
func clusters(t *testing.T) *pgcluster.Set {
	t.Helper()
	setOnce.Do(func() { set, setErr = pgcluster.NewSet() })
	require.NoError(t, setErr, "the failover tests run their own clusters from PostgreSQL's server binaries (Debian: postgresql-15; IDEM_PG_BINDIR names another directory)")
	return set
}

// stop kills c when the test ends, showing its log if the test failed.
func stopAtEnd(t *testing.T, c *pgcluster.Cluster) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of %s:\n%s", c.Name, c.Log())
		}
		require.NoError(t, c.Kill())
	})
}

// schema is the idempotency table and the handler's ledger. The ledger has
// no unique constraint on event_id: an event processed twice shows as two
// rows.
const schema = `CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, receiver text NOT NULL)`

// migrate creates the idempotency table and the ledger through db.
func migrate(t *testing.T, db *sql.DB) {
	t.Helper()
	require.NoError(t, idem.Migrate(context.Background(), db, ""))
	_, err := db.Exec(schema)
	require.NoError(t, err)
}

// admin opens a pool on c for the test's own queries; its commits never
// wait for a standby (synchronous_commit = local).
func admin(t *testing.T, c *pgcluster.Cluster) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", c.URL("postgres")+"&synchronous_commit=local")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// The ways a receiver reaches PostgreSQL. The "-cancel" ones use pgx's
// CancelRequest context watcher, which answers a context that ends during
// a query by asking the server to cancel it: a driver configuration that
// could turn a COMMIT waiting for its standby into a local commit.
const (
	viaPgx          = "pgx"
	viaPgxCancel    = "pgx-cancel"
	viaSQL          = "sql"
	viaSQLCancel    = "sql-cancel"
	viaPgxDetecting = "pgx-detect" // idempgx.DetectUnreplicatedCommits
)

var allVias = []string{viaPgx, viaPgxCancel, viaSQL, viaSQLCancel}

func cancelWatcher(c *pgconn.PgConn) ctxwatch.Handler {
	return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
}

// receiver is one instance of the webhook receiver: an idem middleware on
// its own connection pool, in front of a handler that writes one ledger row
// per event and answers with the row's id and a random nonce, so that an
// event processed again answers differently.
type receiver struct {
	name string
	h    http.Handler
	stop func()
}

func newReceiver(t *testing.T, name, via, url string, opts idem.Options) *receiver {
	t.Helper()
	if opts.KeyFunc == nil {
		opts.KeyFunc = idem.Header("test", "Event-Id")
	}
	var (
		mw   *idem.Middleware
		stop func()
	)
	switch via {
	case viaPgx, viaPgxCancel, viaPgxDetecting:
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.MaxConns = 4
		if via == viaPgxCancel {
			cfg.ConnConfig.BuildContextWatcherHandler = cancelWatcher
		}
		if via == viaPgxDetecting {
			idempgx.DetectUnreplicatedCommits(cfg)
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		mw, err = idempgx.New(pool, opts)
		require.NoError(t, err)
		stop = pool.Close
	case viaSQL, viaSQLCancel:
		cfg, err := pgx.ParseConfig(url)
		require.NoError(t, err)
		if via == viaSQLCancel {
			cfg.BuildContextWatcherHandler = cancelWatcher
		}
		db := stdlib.OpenDB(*cfg)
		db.SetMaxOpenConns(4)
		mw, err = idem.New(db, opts)
		require.NoError(t, err)
		stop = func() { _ = db.Close() }
	default:
		t.Fatalf("unknown receiver kind %q", via)
	}
	r := &receiver{name: name + "/" + via, stop: stop}
	r.h = mw.Handler(http.HandlerFunc(r.handle))
	t.Cleanup(stop)
	return r
}

func (rc *receiver) handle(w http.ResponseWriter, r *http.Request) {
	id, _ := idem.KeyFromContext(r.Context())
	var row int64
	var err error
	if tx, ok := idem.Tx(r.Context()); ok {
		err = tx.QueryRowContext(r.Context(), `INSERT INTO ledger (event_id, receiver) VALUES ($1, $2) RETURNING id`, id.EventID, rc.name).Scan(&row)
	} else if tx, ok := idempgx.Tx(r.Context()); ok {
		err = tx.QueryRow(r.Context(), `INSERT INTO ledger (event_id, receiver) VALUES ($1, $2) RETURNING id`, id.EventID, rc.name).Scan(&row)
	} else {
		err = errors.New("no transaction")
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintf(w, "event %s: ledger row %d by %s, nonce %s", id.EventID, row, rc.name, nonce())
}

func nonce() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// answer is what one delivery got.
type answer struct {
	status   int
	body     string
	replayed bool
}

// deliver sends event to the receiver, as the provider's retry would.
func (rc *receiver) deliver(event string) answer {
	req := httptest.NewRequest(http.MethodPost, "/webhook", strings.NewReader(`{"event":"`+event+`"}`))
	req.Header.Set("Event-Id", event)
	w := httptest.NewRecorder()
	rc.h.ServeHTTP(w, req)
	b, _ := io.ReadAll(w.Result().Body)
	return answer{status: w.Code, body: string(b), replayed: w.Header().Get("Idempotent-Replayed") == "true"}
}

// poll calls cond until it is true or the bound passes (for server states
// that offer nothing to await: a backend's wait event, a reloaded setting).
func poll(t *testing.T, what string, bound time.Duration, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for {
		ok, err := cond()
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v (last error: %v)", what, bound, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// syncRepWaiters counts the sessions whose COMMIT waits for a synchronous
// standby.
func syncRepWaiters(db *sql.DB) (n int, err error) {
	err = db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&n)
	return n, err
}

// releaseWaits empties synchronous_standby_names on the server of db: the
// COMMITs waiting for a standby end, committed.
func releaseWaits(t *testing.T, db *sql.DB) {
	t.Helper()
	_, err := db.Exec(`ALTER SYSTEM SET synchronous_standby_names = ''`)
	require.NoError(t, err)
	_, err = db.Exec(`SELECT pg_reload_conf()`)
	require.NoError(t, err)
}
