// Package citustest holds the tests of idem on Citus: a coordinator named
// by IDEM_CITUS_URL and, for queries from any node, a worker named by
// IDEM_CITUS_WORKER_URL (one database, with the citus extension created on
// every node, the workers added to the coordinator). Citus is not packaged
// for the machines CI runs on, so these tests run only where those
// variables are set, and say so when they are not (docs/citus.md). Each
// test first asserts that it talks to Citus, so it cannot pass against
// plain PostgreSQL.
package citustest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("IDEM_CITUS_URL") == "" {
		fmt.Println("citustest: IDEM_CITUS_URL is not set: the Citus suite did not run (docs/citus.md says how to run it)")
	}
	goleak.VerifyTestMain(m)
}

// adapters are the two ways a middleware reaches PostgreSQL.
var adapters = []string{"database/sql", "pgx"}

// node is one Citus node the tests connect to.
type node struct {
	url string
	db  *sql.DB
}

// cluster is the coordinator and, if named, a worker.
type cluster struct {
	coord, worker *node
}

// citus returns the cluster named by IDEM_CITUS_URL (and
// IDEM_CITUS_WORKER_URL), after asserting that it is Citus with at least
// two active workers; without IDEM_CITUS_URL the test is skipped, saying
// so. needWorker: the test needs IDEM_CITUS_WORKER_URL too.
func citus(t *testing.T, needWorker bool) *cluster {
	t.Helper()
	u := os.Getenv("IDEM_CITUS_URL")
	if u == "" {
		t.Log("IDEM_CITUS_URL is not set: this Citus test did not run")
		t.Skip("skipped: set IDEM_CITUS_URL to a Citus coordinator (and IDEM_CITUS_WORKER_URL to a worker) to run the Citus suite")
	}
	c := &cluster{coord: open(t, u)}
	var version string
	require.NoError(t, c.coord.db.QueryRow(`SELECT citus_version()`).Scan(&version))
	require.Contains(t, version, "Citus")
	var workers int
	require.NoError(t, c.coord.db.QueryRow(`SELECT count(*) FROM pg_dist_node
WHERE groupid > 0 AND isactive AND noderole = 'primary' AND shouldhaveshards`).Scan(&workers))
	require.GreaterOrEqual(t, workers, 2, "the coordinator should have two active workers")
	if w := os.Getenv("IDEM_CITUS_WORKER_URL"); w != "" {
		c.worker = open(t, w)
		var group int
		require.NoError(t, c.worker.db.QueryRow(`SELECT groupid FROM pg_dist_local_group`).Scan(&group))
		require.Positive(t, group, "IDEM_CITUS_WORKER_URL should name a worker")
	} else if needWorker {
		t.Fatal("IDEM_CITUS_WORKER_URL is not set: this test needs a worker to send queries from any node")
	}
	return c
}

func open(t *testing.T, u string) *node {
	t.Helper()
	db, err := sql.Open("pgx", u)
	require.NoError(t, err)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.Ping())
	return &node{url: u, db: db}
}

// tables are a test's idempotency table and its handler's ledger, both
// distributed by event_id and colocated.
type tables struct {
	idem, ledger string
}

// newTables creates them: the ledger distributed first, then the
// idempotency table migrated and distributed colocated with it, as
// docs/citus.md says; asserts both rows of pg_dist_partition.
func (c *cluster) newTables(t *testing.T) tables {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	ts := tables{idem: "idem_" + hex.EncodeToString(b), ledger: "ledger_" + hex.EncodeToString(b)}
	db := c.coord.db
	ctx := context.Background()
	_, err := db.Exec(`CREATE TABLE ` + ts.ledger + ` (event_id text NOT NULL, node text NOT NULL, at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = db.Exec(`DROP TABLE IF EXISTS ` + ts.ledger + `, ` + ts.idem)
	})
	_, err = db.Exec(`SELECT create_distributed_table($1, 'event_id')`, ts.ledger)
	require.NoError(t, err)
	require.NoError(t, idem.Migrate(ctx, db, ts.idem))
	d, err := idemops.Distribute(ctx, db, idemops.DistributeOptions{Table: ts.idem, ColocateWith: ts.ledger})
	require.NoError(t, err)
	require.True(t, d.Distributed)
	var method, column string
	var sameGroup bool
	require.NoError(t, db.QueryRow(`SELECT p.partmethod::text, column_to_column_name(p.logicalrelid, p.partkey),
       p.colocationid = (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = $2::regclass)
FROM pg_dist_partition p WHERE p.logicalrelid = $1::regclass`, ts.idem, ts.ledger).Scan(&method, &column, &sameGroup))
	require.Equal(t, "h", method, "the idempotency table should be hash-distributed")
	require.Equal(t, "event_id", column)
	require.True(t, sameGroup, "the idempotency table should be colocated with the ledger")
	return ts
}

// newMiddleware returns a middleware of adapter on n's database, claiming
// in ts.idem, keyed by the X-Event-Id header.
func newMiddleware(t *testing.T, n *node, adapter string, ts tables, opts idem.Options) *idem.Middleware {
	t.Helper()
	opts.Table = ts.idem
	if opts.KeyFunc == nil {
		opts.KeyFunc = idem.Header("test", "X-Event-Id")
	}
	if adapter == "pgx" {
		cfg, err := pgxpool.ParseConfig(n.url)
		require.NoError(t, err)
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		mw, err := idempgx.New(pool, opts)
		require.NoError(t, err)
		return mw
	}
	mw, err := idem.New(n.db, opts)
	require.NoError(t, err)
	return mw
}

// exec runs a statement in the request's transaction, whichever adapter
// began it (in lease mode, beginning it).
func exec(r *http.Request, query string, args ...any) error {
	if tx, ok := idem.Tx(r.Context()); ok {
		_, err := tx.ExecContext(r.Context(), query, args...)
		return err
	}
	if tx, ok := idempgx.Tx(r.Context()); ok {
		_, err := tx.Exec(r.Context(), query, args...)
		return err
	}
	return fmt.Errorf("no transaction in the request's context")
}

// queryPID returns the backend pid of the request's transaction.
func queryPID(r *http.Request) (int, error) {
	var pid int
	if tx, ok := idem.Tx(r.Context()); ok {
		return pid, tx.QueryRowContext(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid)
	}
	if tx, ok := idempgx.Tx(r.Context()); ok {
		return pid, tx.QueryRow(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid)
	}
	return 0, fmt.Errorf("no transaction in the request's context")
}

// ledgerHandler writes one ledger row for the event, from node, then calls
// hook (if any) and answers 201 "done <event id>".
func ledgerHandler(ts tables, nodeName string, hook func(r *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("X-Event-Id")
		if err := exec(r, `INSERT INTO `+ts.ledger+` (event_id, node) VALUES ($1, $2)`, id, nodeName); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if hook != nil {
			hook(r)
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("done " + id))
	})
}

// serve delivers event id with body through h.
func serve(h http.Handler, id, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader(body))
	req.Header.Set("X-Event-Id", id)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// ledgerRows counts the ledger's rows for id.
func ledgerRows(t *testing.T, db *sql.DB, ts tables, id string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+ts.ledger+` WHERE event_id = $1`, id).Scan(&n))
	return n
}

// waitForClaimWaiting polls n until a session there runs the claim's
// INSERT on ts.idem: a duplicate waiting at its INSERT for the original.
// (No event says so: PostgreSQL is asked, with a deadline.)
func waitForClaimWaiting(t *testing.T, n *node, ts tables) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting int
		require.NoError(t, n.db.QueryRow(`SELECT count(*) FROM pg_stat_activity
WHERE state = 'active' AND pid <> pg_backend_pid() AND query LIKE 'INSERT INTO "' || $1 || '" (source, event_id, payload_digest) VALUES%'`, ts.idem).Scan(&waiting))
		if waiting > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("gave up waiting for the duplicate's claim to wait for its original")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
