// Command chi receives Shopify order webhooks on a go-chi/chi router: the
// idempotency middleware is installed with r.Use on the webhook sub-router
// only, next to a /metrics endpoint that shows what it does.
//
//	go run ./chi
//	curl -i -X POST -H 'X-Shopify-Event-Id: 8f1e5c3a' -d '{"id":820982911946154508,"email":"jon@example.com","total_price":"199.00"}' \
//	  http://127.0.0.1:8080/webhooks/shopify/orders-create
//	curl -s http://127.0.0.1:8080/metrics | grep ^idem_
//
// A real receiver also verifies X-Shopify-Hmac-Sha256 before the claim, as
// the stripe example does for its signature.
package main

import (
	"context"
	"database/sql"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	example.Main(func(ctx context.Context, db *sql.DB) (http.Handler, error) {
		if err := migrate(ctx, db); err != nil {
			return nil, err
		}
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		return newServer(db, reg)
	})
}

// migrate creates the idempotency table and the fulfillment queue.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS fulfillments (
		id         bigserial   PRIMARY KEY,
		order_id   bigint      NOT NULL,
		email      text        NOT NULL,
		total      numeric     NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}
