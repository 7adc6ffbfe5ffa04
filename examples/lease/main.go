// Command lease charges cards through a slow payment API behind idem's
// lease mode: the claim of the Idempotency-Key, scoped by the client that
// the authentication middleware before it verified, commits at once with a
// lease, no connection is held while the payment API is called, and the
// record of the charge commits with the stored answer only if the lease
// still owns the key. The request's key is passed on to the payment API as
// its own Idempotency-Key, so a delivery that takes over after a crash
// does not charge twice. A fake payment API runs in the same process.
//
//	go run ./lease
//	curl -i -X POST -H 'Authorization: Bearer token-a' -H 'Idempotency-Key: "order-1"' \
//	  -d '{"customer":"cus_1","amount":1999}' \
//	  http://127.0.0.1:8080/charges
package main

import (
	"context"
	"database/sql"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	payments := httptest.NewServer(newPaymentAPI()) // stands in for the provider
	defer payments.Close()
	example.Main(func(ctx context.Context, db *sql.DB) (http.Handler, error) {
		if err := migrate(ctx, db); err != nil {
			return nil, err
		}
		c := &charger{payments: payments.URL, client: &http.Client{Timeout: 20 * time.Second}}
		return newServer(db, c, 30*time.Second)
	})
}

// migrate creates the idempotency table and the charges table.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS charges (
		charge_id  text        PRIMARY KEY,
		customer   text        NOT NULL,
		amount     bigint      NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}
