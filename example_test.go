package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/pgidem/idem"
)

// A Stripe webhook endpoint: the event runs once, however often it arrives.
func Example() {
	db, table := idem.ExampleDB() // a *sql.DB opened with the pgx driver; Migrate has run
	defer db.Close()

	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe(), Table: table})
	if err != nil {
		panic(err)
	}
	runs := 0
	handler := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"received": true}`)
	}))
	srv := httptest.NewServer(handler)
	defer srv.Close()

	for i := 0; i < 3; i++ {
		res, err := http.Post(srv.URL, "application/json", strings.NewReader(`{"id": "evt_1", "type": "charge.succeeded"}`))
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		fmt.Printf("%d %s replayed=%q\n", res.StatusCode, strings.TrimSpace(string(body)), res.Header.Get("Idempotent-Replayed"))
	}
	fmt.Println("handler runs:", runs)
	// Output:
	// 200 {"received": true} replayed=""
	// 200 {"received": true} replayed="true"
	// 200 {"received": true} replayed="true"
	// handler runs: 1
}

// The handler writes through the middleware's transaction, so its writes
// commit together with the claim and the stored answer, or not at all.
func ExampleTx() {
	db, table := idem.ExampleDB()
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE orders_` + table + ` (id bigserial PRIMARY KEY, event_id text)`); err != nil {
		panic(err)
	}

	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Header("shop", "X-Event-Id"), Table: table})
	if err != nil {
		panic(err)
	}
	handler := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := idem.Tx(r.Context())
		if !ok {
			http.Error(w, "not idempotent", http.StatusInternalServerError)
			return
		}
		key, _ := idem.KeyFromContext(r.Context())
		var id int64
		err := tx.QueryRowContext(r.Context(),
			`INSERT INTO orders_`+table+` (event_id) VALUES ($1) RETURNING id`, key.EventID).Scan(&id)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // not 2xx: rolled back
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", id)
	}))

	for i := 0; i < 2; i++ {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		req.Header.Set("X-Event-Id", "evt_42")
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Body.String())
	}
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM orders_` + table).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 order 1
	// 201 order 1
	// orders: 1
}

// A custom KeyFunc: the source comes from the route, the id from a header.
func ExampleKeyFunc() {
	byRoute := func(r *http.Request, body []byte) (idem.Key, error) {
		return idem.Key{Source: r.PathValue("source"), EventID: r.Header.Get("X-Event-Id")}, nil
	}
	db, table := idem.ExampleDB()
	defer db.Close()
	mw, err := idem.New(db, idem.Options{KeyFunc: byRoute, Table: table})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/{source}", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := idem.KeyFromContext(r.Context())
		fmt.Fprintf(w, "%s/%s", key.Source, key.EventID)
	})))

	for _, path := range []string{"/webhooks/acme", "/webhooks/globex"} {
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(`{}`))
		req.Header.Set("X-Event-Id", "evt_1")
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Println(rec.Code, rec.Body.String())
	}
	// Output:
	// 200 acme/evt_1
	// 200 globex/evt_1
}

func ExampleJSONField() {
	kf := idem.JSONField("paddle", "data.event_id")
	body := []byte(`{"data": {"event_id": "evt_01h8", "amount": 10}}`)
	key, err := kf(httptest.NewRequest(http.MethodPost, "/", nil), body)
	fmt.Println(key.Source, key.EventID, err)
	// Output: paddle evt_01h8 <nil>
}

func ExampleParseIdempotencyKey() {
	for _, v := range []string{`"8e03978e-40d5-43e8"`, `8e03978e-40d5-43e8`, `"unterminated`} {
		key, err := idem.ParseIdempotencyKey(v)
		fmt.Printf("%q %v\n", key, err)
	}
	// Output:
	// "8e03978e-40d5-43e8" <nil>
	// "8e03978e-40d5-43e8" <nil>
	// "" idem: invalid idempotency key: Idempotency-Key has no closing quote
}

func ExampleMigrate() {
	db, _ := idem.ExampleDB()
	defer db.Close()
	// Safe to run at every start, from every instance at once.
	for i := 0; i < 2; i++ {
		if err := idem.Migrate(context.Background(), db, "billing_webhooks"); err != nil {
			panic(err)
		}
	}
	var cols int
	_ = db.QueryRow(`SELECT count(*) FROM information_schema.columns WHERE table_name = 'billing_webhooks'`).Scan(&cols)
	fmt.Println("columns:", cols)
	// Output: columns: 8
}

func ExampleMigrateWith() {
	db, _ := idem.ExampleDB()
	defer db.Close()
	// A table partitioned by week: the current week's partition and three
	// ahead. Run it (or idem sweep) at least once a week to keep them ahead.
	opts := idem.MigrateOptions{Table: "weekly_webhooks", PartitionInterval: 7 * 24 * time.Hour}
	if err := idem.MigrateWith(context.Background(), db, opts); err != nil {
		panic(err)
	}
	var partitions int
	_ = db.QueryRow(`SELECT count(*) FROM pg_inherits WHERE inhparent = 'weekly_webhooks'::regclass`).Scan(&partitions)
	fmt.Println("partitions:", partitions)
	// Output: partitions: 4
}
