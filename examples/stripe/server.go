package main

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/pgidem/idem"
)

// newServer serves POST /webhooks/stripe: signature verification first,
// then the idempotency middleware with the Stripe preset (the event's "id"),
// then the handler.
func newServer(db *sql.DB, secret string) (http.Handler, error) {
	mw, err := idem.New(db, idem.Options{
		KeyFunc: idem.Stripe(),
		// Stripe waits about 10 seconds for an answer: a duplicate should
		// hear 409 well before that, and retry.
		LockWait: 2 * time.Second,
	})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", verifySignature(secret, time.Now)(mw.Handler(http.HandlerFunc(receive))))
	return mux, nil
}

// event is the part of a Stripe event this receiver uses.
type event struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Data struct {
		Object struct {
			ID       string `json:"id"`
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
		} `json:"object"`
	} `json:"data"`
}

// receive records succeeded payments, in the transaction that holds the
// claim, and acknowledges every other event type without doing anything.
func receive(w http.ResponseWriter, r *http.Request) {
	var ev event
	if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
		http.Error(w, "not a Stripe event", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if ev.Type != "payment_intent.succeeded" {
		fmt.Fprintln(w, `{"received":true}`)
		return
	}
	tx, ok := idem.Tx(r.Context())
	if !ok {
		http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
		return
	}
	pi := ev.Data.Object
	var id int64
	err := tx.QueryRowContext(r.Context(),
		`INSERT INTO stripe_payments (payment_intent, amount, currency) VALUES ($1, $2, $3) RETURNING id`,
		pi.ID, pi.Amount, pi.Currency).Scan(&id)
	if err != nil {
		http.Error(w, "cannot record the payment", http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintf(w, `{"received":true,"payment_id":%d}`+"\n", id)
}
