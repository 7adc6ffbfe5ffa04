package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverdatabasesql"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/pgidem/idem"
)

// migrate creates River's tables, the idempotency table, the orders and the
// stock.
func migrate(ctx context.Context, db *sql.DB) error {
	migrator, err := rivermigrate.New(riverdatabasesql.New(db), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("river migrations: %w", err)
	}
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err = db.ExecContext(ctx, `
		CREATE TABLE IF NOT EXISTS orders (
			id       bigserial PRIMARY KEY,
			sku      text      NOT NULL,
			quantity int       NOT NULL,
			email    text      NOT NULL);
		CREATE TABLE IF NOT EXISTS stock (
			sku       text PRIMARY KEY,
			available int  NOT NULL CHECK (available >= 0))`)
	return err
}

// Email is a message to send. Key identifies it to the email provider: River
// runs a job at least once, so a worker that crashes after sending may send
// again, and a provider that honours idempotency keys drops the second one.
type Email struct {
	Key, To, Subject, Body string
}

// Mailer sends email: the side effect that no transaction can take back.
type Mailer interface {
	Send(ctx context.Context, m Email) error
}

// confirmationEmail is the job that sends an order's confirmation.
type confirmationEmail struct {
	OrderID int64  `json:"order_id"`
	Email   string `json:"email"`
}

// Kind names the job for River.
func (confirmationEmail) Kind() string { return "order_confirmation_email" }

// emailWorker sends confirmation emails, after the order has committed.
type emailWorker struct {
	river.WorkerDefaults[confirmationEmail]
	mailer Mailer
}

// Work sends one confirmation.
func (w *emailWorker) Work(ctx context.Context, job *river.Job[confirmationEmail]) error {
	return w.mailer.Send(ctx, Email{
		Key:     fmt.Sprintf("order-confirmation-%d", job.Args.OrderID),
		To:      job.Args.Email,
		Subject: fmt.Sprintf("Order %d confirmed", job.Args.OrderID),
		Body:    "Thank you for your order.",
	})
}

// newRiver returns a River client on the database/sql driver, with the email
// worker. The driver cannot LISTEN, so workers poll for jobs every
// pollInterval.
func newRiver(db *sql.DB, mailer Mailer, logger *slog.Logger, pollInterval time.Duration) (*river.Client[*sql.Tx], error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &emailWorker{mailer: mailer})
	return river.NewClient(riverdatabasesql.New(db), &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 10}},
		Workers:           workers,
		FetchCooldown:     min(pollInterval, 100*time.Millisecond),
		FetchPollInterval: pollInterval,
		Logger:            logger,
	})
}

// newServer serves POST /orders under the idempotency middleware; clients
// send an Idempotency-Key header and retry with the same one.
func newServer(db *sql.DB, jobs *river.Client[*sql.Tx]) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{KeyFunc: idem.IdempotencyKey("orders")})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Handler(placeOrder(jobs)))
	return mux, nil
}

// order is what a client posts.
type order struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
	Email    string `json:"email"`
}

// placeOrder records the order, enqueues its confirmation email and takes it
// from stock, all in the transaction that holds the claim. The email job is
// enqueued before the stock is checked: when the stock runs out, the answer
// is 409, the middleware rolls back, and the job goes with the order row;
// nobody is told about an order that does not exist.
func placeOrder(jobs *river.Client[*sql.Tx]) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, ok := idem.Tx(ctx)
		if !ok {
			http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
			return
		}
		var o order
		if err := json.NewDecoder(r.Body).Decode(&o); err != nil || o.SKU == "" || o.Quantity <= 0 || o.Email == "" {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "want sku, a positive quantity and email"})
			return
		}
		var orderID int64
		err := tx.QueryRowContext(ctx, `INSERT INTO orders (sku, quantity, email) VALUES ($1, $2, $3) RETURNING id`,
			o.SKU, o.Quantity, o.Email).Scan(&orderID)
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "cannot record the order"})
			return
		}
		job, err := jobs.InsertTx(ctx, tx, confirmationEmail{OrderID: orderID, Email: o.Email}, nil)
		if err != nil {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "cannot enqueue the confirmation"})
			return
		}
		var left int
		err = tx.QueryRowContext(ctx, `UPDATE stock SET available = available - $2
			WHERE sku = $1 AND available >= $2 RETURNING available`, o.SKU, o.Quantity).Scan(&left)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			writeJSON(w, http.StatusConflict, map[string]string{"error": "out of stock"})
			return
		case err != nil:
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "cannot reserve the stock"})
			return
		}
		writeJSON(w, http.StatusCreated, map[string]int64{"order_id": orderID, "confirmation_job": job.Job.ID})
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
