// Command idempgx builds the middleware on a pgx pool, as a user of
// idem's pgx package does.
package main

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem/idempgx"
)

func main() {
	// The pool connects on first use, which never comes.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	check(err)
	defer pool.Close()
	mw, err := idempgx.New(pool, options())
	check(err)
	refuse("idempgx", mw.Handler(http.NotFoundHandler()))
}
