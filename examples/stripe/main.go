// Command stripe receives Stripe webhooks: it verifies the Stripe-Signature
// header first, then claims the event id with the idem.Stripe() preset, so
// a forged request can never claim, or poison, a real event's id.
//
//	STRIPE_WEBHOOK_SECRET=whsec_... go run ./stripe
//	stripe listen --forward-to 127.0.0.1:8080/webhooks/stripe   # prints the secret
//	stripe trigger payment_intent.succeeded
package main

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"os"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	example.Main(func(ctx context.Context, db *sql.DB) (http.Handler, error) {
		secret := os.Getenv("STRIPE_WEBHOOK_SECRET")
		if secret == "" {
			return nil, errors.New("set STRIPE_WEBHOOK_SECRET to the endpoint's signing secret (whsec_...; `stripe listen` prints one)")
		}
		if err := migrate(ctx, db); err != nil {
			return nil, err
		}
		return newServer(db, secret)
	})
}

// migrate creates the idempotency table and the Stripe payments.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS stripe_payments (
		id             bigserial   PRIMARY KEY,
		payment_intent text        NOT NULL,
		amount         bigint      NOT NULL,
		currency       text        NOT NULL,
		recorded_at    timestamptz NOT NULL DEFAULT now())`)
	return err
}
