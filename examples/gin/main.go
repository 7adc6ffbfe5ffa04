// Command gin receives Stripe webhooks on a gin router: idemgin.Wrap puts
// the idempotency middleware on the webhook group only, after
// gin.Recovery, and the handler records each payment once, in the
// transaction that holds the claim of its event.
//
//	go run ./gin
//	curl -i -X POST -H 'Content-Type: application/json' \
//	  -d '{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1","amount":1999}}}' \
//	  http://127.0.0.1:8080/webhooks/stripe
//
// A real receiver also verifies Stripe-Signature before the claim, as the
// stripe example does.
package main

import (
	"context"
	"database/sql"
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	gin.SetMode(gin.ReleaseMode)
	example.Main(func(ctx context.Context, db *sql.DB) (http.Handler, error) {
		if err := migrate(ctx, db); err != nil {
			return nil, err
		}
		return newRouter(db)
	})
}

// migrate creates the idempotency table and the payments table.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id             bigserial   PRIMARY KEY,
		payment_intent text        NOT NULL,
		amount         bigint      NOT NULL,
		created_at     timestamptz NOT NULL DEFAULT now())`)
	return err
}
