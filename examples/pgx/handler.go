package main

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/examples/pgx/paymentsdb"
	"github.com/pgidem/idem/idempgx"
)

// event is the part of a Stripe event this receiver uses.
type event struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Data struct {
		Object struct {
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
		} `json:"object"`
	} `json:"data"`
}

// newHandler returns the webhook handler, to be mounted behind an idempgx
// middleware: it records succeeded payments and acknowledges every other
// event type without doing anything.
func newHandler(pool *pgxpool.Pool) http.Handler {
	queries := paymentsdb.New(pool)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The transaction that holds the claim: writes made through it
		// commit with the stored answer when the handler answers 2xx, and
		// roll back otherwise, so that the sender's retry runs again.
		tx, ok := idempgx.Tx(r.Context())
		if !ok {
			http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
			return
		}
		var ev event
		if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
			http.Error(w, "not a Stripe event", http.StatusBadRequest)
			return
		}
		if ev.Type != "payment_intent.succeeded" {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintln(w, `{"received":true}`)
			return
		}
		pi := ev.Data.Object
		if pi.Amount <= 0 || pi.Currency == "" {
			http.Error(w, "a payment needs an amount and a currency", http.StatusBadRequest)
			return
		}
		// The middleware owns tx: never call Commit or Rollback on it.
		id, err := queries.WithTx(tx).RecordPayment(r.Context(), paymentsdb.RecordPaymentParams{
			EventID:  ev.ID, // the id the middleware claimed: idem.Stripe() reads the same field
			Amount:   pi.Amount,
			Currency: pi.Currency,
		})
		if err != nil {
			http.Error(w, "cannot record the payment", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payment_id":%d}`+"\n", id)
	})
}
