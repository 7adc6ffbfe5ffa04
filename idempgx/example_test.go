package idempgx_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/testdb"
)

// The examples run against PostgreSQL, in a database of their own that
// TestMain creates (on the server at DATABASE_URL, default the local one)
// and drops; while they run, DATABASE_URL points at it, so the examples
// open os.Getenv("DATABASE_URL") as an application does.
func TestMain(m *testing.M) {
	u, name, err := testdb.Create("idempgx_example")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idempgx examples: PostgreSQL is required:", err)
		os.Exit(1)
	}
	admin, hadAdmin := os.LookupEnv("DATABASE_URL")
	os.Setenv("DATABASE_URL", u)
	code := m.Run()
	if hadAdmin { // the database is dropped through the server's admin URL
		os.Setenv("DATABASE_URL", admin)
	} else {
		os.Unsetenv("DATABASE_URL")
	}
	if err := testdb.Drop(name); err != nil {
		fmt.Fprintln(os.Stderr, "idempgx examples: drop database:", err)
	}
	os.Exit(code)
}

// A Stripe webhook receiver on a pgx pool: the handler's write commits
// together with the claim of the event and its stored answer, and a
// redelivery gets the same answer without running the handler again.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := idempgx.Migrate(ctx, pool, ""); err != nil { // the default table
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS payments (event_id text PRIMARY KEY)`); err != nil {
		panic(err)
	}

	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Stripe()})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := idempgx.Tx(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		key, _ := idem.KeyFromContext(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO payments (event_id) VALUES ($1)`, key.EventID); err != nil {
			http.Error(w, "could not record the payment", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "recorded %s\n", key.EventID)
	})))

	for i := 0; i < 2; i++ { // a delivery and its redelivery
		req := httptest.NewRequest(http.MethodPost, "/webhooks/stripe",
			strings.NewReader(`{"id":"evt_1","type":"payment_intent.succeeded"}`))
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Print(rec.Code, " replayed=", rec.Header().Get("Idempotent-Replayed") == "true", " ", rec.Body.String())
	}
	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&n)
	fmt.Println("payments:", n)
	// Output:
	// 201 replayed=false recorded evt_1
	// 201 replayed=true recorded evt_1
	// payments: 1
}

// The transaction belongs to the middleware: the handler's Commit is
// refused and sends nothing, and the request is answered 500 and rolled
// back, so the sender's redelivery runs again.
func ExampleTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := idempgx.Migrate(ctx, pool, "example_tx_keys"); err != nil {
		panic(err)
	}
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("shop", "X-Event-Id"), Table: "example_tx_keys"})
	if err != nil {
		panic(err)
	}
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idempgx.Tx(r.Context())
		err := tx.Commit(r.Context())
		fmt.Println("commit refused:", err != nil)
		w.WriteHeader(http.StatusOK)
	}))
	req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader("{}"))
	req.Header.Set("X-Event-Id", "evt_1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println(rec.Code)
	// Output:
	// commit refused: true
	// 500
}

// On a primary with a synchronous standby, a COMMIT whose wait for the
// standby someone cancels commits locally, unreplicated, and PostgreSQL
// answers it with success and a WARNING. With the detection set on the
// pool's configuration, such a request is answered 503 instead of 2xx.
// (This server has no standby: the event is simply answered.)
func ExampleDetectUnreplicatedCommits() {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL")) // in production: a multi-host DSN, target_session_attrs=read-write
	if err != nil {
		panic(err)
	}
	idempgx.DetectUnreplicatedCommits(cfg) // before the pool is built
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := idempgx.Migrate(ctx, pool, "example_detect_keys"); err != nil {
		panic(err)
	}
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("shop", "X-Event-Id"), Table: "example_detect_keys"})
	if err != nil {
		panic(err)
	}
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "done")
	}))
	req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader("{}"))
	req.Header.Set("X-Event-Id", "evt_1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Print(rec.Code, " ", rec.Body.String())
	// Output:
	// 200 done
}
