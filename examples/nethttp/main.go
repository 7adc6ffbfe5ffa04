// Command nethttp receives webhooks on the standard library's router:
// POST /webhooks/{source}, where the route names the sender and the
// X-Event-Id header carries the id that stays the same across its retries.
// Each event is stored in an inbox table exactly once.
//
//	go run ./nethttp
//	curl -i -X POST -H 'X-Event-Id: evt_1' -d '{"hello":"world"}' http://127.0.0.1:8080/webhooks/acme
//
// Send the curl twice: the second answer is the first one, replayed.
package main

import (
	"context"
	"database/sql"
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
)

func main() { example.Main(setup) }

// setup creates the tables and returns the server.
func setup(ctx context.Context, db *sql.DB) (http.Handler, error) {
	if err := migrate(ctx, db); err != nil {
		return nil, err
	}
	return newServer(db, "acme", "globex")
}

// migrate creates the idempotency table and the inbox.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS inbox (
		id          bigserial   PRIMARY KEY,
		source      text        NOT NULL,
		event_id    text        NOT NULL,
		payload     bytea       NOT NULL,
		received_at timestamptz NOT NULL DEFAULT now())`)
	return err
}
