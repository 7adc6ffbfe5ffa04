package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/pgidem/idem"
)

// openDB opens the database at DATABASE_URL with a connection cap and
// creates idem's table, as an application does at start-up.
func openDB() *sql.DB {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	db.SetMaxOpenConns(10)
	if err := idem.Migrate(context.Background(), db, ""); err != nil { // "": webhook_idempotency
		panic(err)
	}
	return db
}

// A Stripe webhook endpoint: the event runs once, however often it arrives.
func Example() {
	db := openDB()
	defer db.Close()

	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Stripe()})
	if err != nil {
		panic(err)
	}
	runs := 0
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"received": true}`)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for i := 0; i < 3; i++ {
		res, err := http.Post(srv.URL+"/webhooks/stripe", "application/json", strings.NewReader(`{"id": "evt_1", "type": "charge.succeeded"}`))
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
	db := openDB()
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE orders (id bigserial PRIMARY KEY, event_id text)`); err != nil {
		panic(err)
	}

	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Header("shop", "X-Event-Id")})
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
			`INSERT INTO orders (event_id) VALUES ($1) RETURNING id`, key.EventID).Scan(&id)
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
	_ = db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 order 1
	// 201 order 1
	// orders: 1
}

// A queue consumer: the broker delivers each message at least once, and Do
// runs the handler once per message id, its write committed with the claim.
// The error tells the consumer what to do with the message.
func ExampleMiddleware_Do() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(10)
	if err := idem.Migrate(ctx, db, "inbox"); err != nil {
		panic(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE shipments (order_id text NOT NULL)`); err != nil {
		panic(err)
	}
	// No KeyFunc: Do's caller passes each key.
	mw, err := idem.New(db, idem.Options{Table: "inbox"})
	if err != nil {
		panic(err)
	}

	type message struct{ ID, Body string }
	consume := func(ctx context.Context, msg message) {
		key := idem.Key{Source: "orders-queue", EventID: msg.ID}
		res, err := mw.Do(ctx, key, []byte(msg.Body), func(ctx context.Context) ([]byte, error) {
			tx, _ := idem.Tx(ctx)
			if _, err := tx.ExecContext(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, msg.Body); err != nil {
				return nil, err // rolled back: a redelivery runs again
			}
			return []byte("shipped " + msg.Body), nil
		})
		switch {
		case err == nil:
			fmt.Printf("ack %s: %s (replayed: %v)\n", msg.ID, res.Value, res.Replayed)
		case idem.Retryable(err):
			fmt.Printf("retry %s later\n", msg.ID)
		default:
			fmt.Printf("dead-letter %s: %v\n", msg.ID, err)
		}
	}

	consume(ctx, message{"msg-1", "order-7"})
	consume(ctx, message{"msg-1", "order-7"}) // redelivered
	consume(ctx, message{"msg-1", "order-8"}) // the id reused for another message
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM shipments`).Scan(&n)
	fmt.Println("shipments:", n)
	// Output:
	// ack msg-1: shipped order-7 (replayed: false)
	// ack msg-1: shipped order-7 (replayed: true)
	// dead-letter msg-1: idem: key reused with a different request body
	// shipments: 1
}

// A custom KeyFunc: the source comes from the route, the id from a header.
func ExampleKeyFunc() {
	byRoute := func(r *http.Request, body []byte) (idem.Key, error) {
		return idem.Key{Source: r.PathValue("source"), EventID: r.Header.Get("X-Event-Id")}, nil
	}
	db := openDB()
	defer db.Close()
	mw, err := idem.New(db, idem.Options{KeyFunc: byRoute})
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

// Presets scope keys by endpoint; WithSource gives endpoints one scope.
func ExampleKeyFunc_WithSource() {
	body := []byte(`{"id": "evt_1", "type": "invoice.paid"}`)
	for _, path := range []string{"/webhooks/stripe", "/webhooks/stripe-billing"} {
		r := httptest.NewRequest(http.MethodPost, path, nil)
		own, _ := idem.Stripe()(r, body)
		shared, _ := idem.Stripe().WithSource("stripe")(r, body)
		fmt.Printf("%q %q\n", own.Source, shared.Source)
	}
	// Output:
	// "stripe POST /webhooks/stripe" "stripe"
	// "stripe POST /webhooks/stripe-billing" "stripe"
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
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
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
	// Output: columns: 10
}

func ExampleMigrateWith() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
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
