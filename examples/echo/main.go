// Command echo receives billing webhooks that follow the Standard Webhooks
// specification (webhook-id header) on a labstack/echo server: the
// idempotency middleware is installed on the webhook group with
// e.Group("/webhooks", echo.WrapMiddleware(mw.Handler), renderErrors), and
// the handler reaches the transaction through c.Request().Context().
//
//	go run ./echo
//	curl -i -X POST -H 'webhook-id: msg_2KWPBgLlAfxdpx2AI54pPJ85f4W' \
//	  -d '{"type":"invoice.paid","data":{"account":"acct_1","invoice":"in_1","amount":1200}}' \
//	  http://127.0.0.1:8080/webhooks/billing
//
// The program creates the account acct_1 to pay into.
package main

import (
	"context"
	"database/sql"
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	example.Main(func(ctx context.Context, db *sql.DB) (http.Handler, error) {
		if err := migrate(ctx, db); err != nil {
			return nil, err
		}
		if _, err := db.ExecContext(ctx, `INSERT INTO accounts (id) VALUES ('acct_1') ON CONFLICT DO NOTHING`); err != nil {
			return nil, err
		}
		return newServer(db)
	})
}

// migrate creates the idempotency table, the accounts and their payments.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `
		CREATE TABLE IF NOT EXISTS accounts (
			id      text   PRIMARY KEY,
			balance bigint NOT NULL DEFAULT 0);
		CREATE TABLE IF NOT EXISTS invoice_payments (
			id      bigserial PRIMARY KEY,
			account text      NOT NULL,
			invoice text      NOT NULL,
			amount  bigint    NOT NULL)`)
	return err
}
