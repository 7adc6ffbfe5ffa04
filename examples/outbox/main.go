// Command outbox takes orders through an API with Idempotency-Key, and sends
// each order's confirmation email exactly once, although an email cannot be
// rolled back: the handler enqueues a River job in the transaction that holds
// the claim, and a River worker sends the email after that transaction has
// committed. A retried request replays the answer and enqueues nothing more;
// a request that fails enqueues nothing at all.
//
//	go run ./outbox
//	curl -i -X POST -H 'Idempotency-Key: "order-7f3a"' -d '{"sku":"mug","quantity":2,"email":"jon@example.com"}' \
//	  http://127.0.0.1:8080/orders
package main

import (
	"context"
	"database/sql"
	"flag"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "address to listen on")
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("outbox: ")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *dsn == "" {
		*dsn = example.DatabaseURL()
	}
	if err := run(ctx, *addr, *dsn); err != nil {
		log.Print(err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, addr, dsn string) error {
	db, err := example.OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := migrate(ctx, db); err != nil {
		return err
	}
	if err := restock(ctx, db, "mug", 100); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	jobs, err := newRiver(db, logMailer{}, logger, 200*time.Millisecond)
	if err != nil {
		return err
	}
	if err := jobs.Start(ctx); err != nil {
		return err
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = jobs.Stop(stopCtx)
	}()
	h, err := newServer(db, jobs)
	if err != nil {
		return err
	}
	return example.Serve(ctx, addr, h)
}

// restock sets how many of sku are available.
func restock(ctx context.Context, db *sql.DB, sku string, n int) error {
	_, err := db.ExecContext(ctx, `INSERT INTO stock (sku, available) VALUES ($1, $2)
		ON CONFLICT (sku) DO UPDATE SET available = excluded.available`, sku, n)
	return err
}

// logMailer "sends" email by logging it.
type logMailer struct{}

func (logMailer) Send(_ context.Context, m Email) error {
	log.Printf("email to %s (idempotency key %s): %s", m.To, m.Key, m.Subject)
	return nil
}
