package main

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemprom"
)

// newServer serves GET /metrics from reg, and POST
// /webhooks/shopify/orders-create through the idempotency middleware, whose
// metrics it registers with reg.
func newServer(db *sql.DB, reg *prometheus.Registry) (http.Handler, error) {
	metrics, err := idemprom.New(reg, idemprom.Options{})
	if err != nil {
		return nil, err
	}
	mw, err := idem.New(db, idem.Options{
		KeyFunc:  idem.Shopify(), // X-Shopify-Event-Id, the same on every retry
		Observer: metrics.Observe,
	})
	if err != nil {
		return nil, err
	}

	r := chi.NewRouter()
	r.Get("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP)
	r.Route("/webhooks/shopify", func(r chi.Router) {
		r.Use(mw.Handler)
		r.Post("/orders-create", ordersCreate)
	})
	return r, nil
}

// order is the part of Shopify's orders/create payload this receiver uses.
type order struct {
	ID         int64       `json:"id"`
	Email      string      `json:"email"`
	TotalPrice json.Number `json:"total_price"`
}

// ordersCreate queues the order for fulfillment, in the transaction that
// holds the claim: a retried webhook can never ship an order twice.
func ordersCreate(w http.ResponseWriter, r *http.Request) {
	var o order
	if err := json.NewDecoder(r.Body).Decode(&o); err != nil || o.ID == 0 || o.TotalPrice == "" {
		// 4xx is not final: the claim rolls back, and nothing is stored.
		http.Error(w, "not an order", http.StatusBadRequest)
		return
	}
	tx, ok := idem.Tx(r.Context())
	if !ok {
		http.Error(w, "not behind the idempotency middleware", http.StatusInternalServerError)
		return
	}
	var id int64
	err := tx.QueryRowContext(r.Context(),
		`INSERT INTO fulfillments (order_id, email, total) VALUES ($1, $2, $3) RETURNING id`,
		o.ID, o.Email, o.TotalPrice.String()).Scan(&id)
	if err != nil {
		http.Error(w, "cannot queue the fulfillment", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"fulfillment_id":%d,"order_id":%d}`+"\n", id, o.ID)
}
