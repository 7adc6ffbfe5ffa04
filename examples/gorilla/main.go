// Command gorilla receives GitHub push webhooks on a gorilla/mux router and
// queues one CI build per push: the idempotency middleware is installed with
// r.Use on the webhook sub-router, keyed by the X-GitHub-Delivery GUID.
//
//	go run ./gorilla
//	curl -i -X POST -H 'X-GitHub-Event: push' -H 'X-GitHub-Delivery: 72d3162e-cc78-11e3-81ab-4c9367dc0958' \
//	  -H 'X-GitHub-Hook-ID: 42' -d '{"ref":"refs/heads/main","after":"6113728f","repository":{"full_name":"octo/hello"}}' \
//	  http://127.0.0.1:8080/webhooks/github
//
// A real receiver also verifies X-Hub-Signature-256 before the claim, as the
// stripe example does for its signature.
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
		return newServer(db)
	})
}

// migrate creates the idempotency table and the build queue.
func migrate(ctx context.Context, db *sql.DB) error {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS builds (
		id        bigserial   PRIMARY KEY,
		repo      text        NOT NULL,
		ref       text        NOT NULL,
		sha       text        NOT NULL,
		queued_at timestamptz NOT NULL DEFAULT now())`)
	return err
}
