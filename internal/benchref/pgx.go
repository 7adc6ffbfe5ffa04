package benchref

import (
	"context"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
)

// LedgerInsertPgx appends one row to the ledger in tx and returns its id.
func LedgerInsertPgx(ctx context.Context, tx pgx.Tx, ledger, eventID string, body []byte) (int64, error) {
	var id int64
	err := tx.QueryRow(ctx, `INSERT INTO `+ledger+` (event_id, body) VALUES ($1, $2) RETURNING id`,
		eventID, body).Scan(&id)
	return id, err
}

// IdemPgxHandler is the handler behind idempgx's middleware: the ledger
// write in the middleware's pgx transaction.
func IdemPgxHandler(ledger string) http.Handler {
	return idemHandler(func(r *http.Request, eventID string, body []byte) (int64, bool, error) {
		tx, ok := idempgx.Tx(r.Context())
		if !ok {
			return 0, false, nil
		}
		id, err := LedgerInsertPgx(r.Context(), tx, ledger, eventID, body)
		return id, true, err
	})
}

// BarePgxHandler is the ledger write in a plain pgx transaction, as a pgx
// user writes it without idempotency: pool.Begin (BEGIN, its own round
// trip), the INSERT, Commit.
func BarePgxHandler(pool *pgxpool.Pool, ledger string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		eventID := r.Header.Get(EventHeader)
		body, err := io.ReadAll(io.LimitReader(r.Body, idem.DefaultMaxBodyBytes))
		if err != nil {
			http.Error(w, "read body", http.StatusBadRequest)
			return
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			http.Error(w, "begin", http.StatusServiceUnavailable)
			return
		}
		defer func() { _ = tx.Rollback(ctx) }()
		id, err := LedgerInsertPgx(ctx, tx, ledger, eventID, body)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, "commit", http.StatusServiceUnavailable)
			return
		}
		WriteJSON(w, http.StatusCreated, Answer(id, eventID))
	})
}
