// Package benchref holds the reference receivers that the benchmarks
// (bench_test.go) and the load tool (bench/cmd/idemload) compare idem
// against, so both measure the same code: the same ledger write behind the
// middleware (IdemHandler), in a plain transaction (BareHandler), and in the
// seed's SQL written by hand (InlineHandler). Not part of the library.
package benchref

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"errors"
	"io"
	"net/http"
	"strconv"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgidem/idem"
)

// The key every reference receiver uses: the event id from EventHeader,
// scoped by Source.
const (
	EventHeader = "X-Event-Id"
	Source      = "bench"
)

// LedgerInsert appends one row to the ledger and returns its id.
func LedgerInsert(ctx context.Context, tx *sql.Tx, ledger, eventID string, body []byte) (int64, error) {
	var id int64
	err := tx.QueryRowContext(ctx, `INSERT INTO `+ledger+` (event_id, body) VALUES ($1, $2) RETURNING id`,
		eventID, body).Scan(&id)
	return id, err
}

// Answer is the handler's JSON answer: the new ledger row's id and the event.
func Answer(id int64, eventID string) []byte {
	b := make([]byte, 0, 48+len(eventID))
	b = append(b, `{"ledger_id":`...)
	b = strconv.AppendInt(b, id, 10)
	b = append(b, `,"event":`...)
	b = strconv.AppendQuote(b, eventID)
	return append(b, "}\n"...)
}

// WriteJSON answers body as application/json with status.
func WriteJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// IdemHandler is the handler behind the middleware: the ledger write in
// the middleware's transaction.
func IdemHandler(ledger string) http.Handler {
	return idemHandler(func(r *http.Request, eventID string, body []byte) (int64, bool, error) {
		tx, ok := idem.Tx(r.Context())
		if !ok {
			return 0, false, nil
		}
		id, err := LedgerInsert(r.Context(), tx, ledger, eventID, body)
		return id, true, err
	})
}

// idemHandler answers the ledger row that insert writes in the request's
// transaction (ok false: there is none).
func idemHandler(insert func(r *http.Request, eventID string, body []byte) (id int64, ok bool, err error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := idem.KeyFromContext(r.Context())
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "read body", http.StatusBadRequest)
			return
		}
		id, ok, err := insert(r, key.EventID, body)
		switch {
		case !ok:
			http.Error(w, "no transaction", http.StatusInternalServerError)
		case err != nil:
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
		default:
			WriteJSON(w, http.StatusCreated, Answer(id, key.EventID))
		}
	})
}

// BareHandler is the ledger write in a plain transaction: no idempotency,
// so a duplicate writes again.
func BareHandler(db *sql.DB, ledger string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		eventID := r.Header.Get(EventHeader)
		body, err := io.ReadAll(io.LimitReader(r.Body, idem.DefaultMaxBodyBytes))
		if err != nil {
			http.Error(w, "read body", http.StatusBadRequest)
			return
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			http.Error(w, "begin", http.StatusServiceUnavailable)
			return
		}
		defer func() { _ = tx.Rollback() }()
		id, err := LedgerInsert(ctx, tx, ledger, eventID, body)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		if err := tx.Commit(); err != nil {
			http.Error(w, "commit", http.StatusServiceUnavailable)
			return
		}
		WriteJSON(w, http.StatusCreated, Answer(id, eventID))
	})
}

// InlineDoSQL is the hand-written claim and completion on table: an INSERT
// of the key that does nothing for a key already there, and the UPDATE
// that stores the value as Do stores it: the transaction that
// Middleware.Do and the consumers built on it are compared with.
func InlineDoSQL(table string) (claim, complete string) {
	q := `"` + table + `"`
	claim = `INSERT INTO ` + q + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING RETURNING 1`
	complete = `UPDATE ` + q + `
SET response_status = 200, response_headers = '{}', response_body = $3, completed_at = now()
WHERE source = $1 AND event_id = $2`
	return claim, complete
}

// InlineHandler is the seed's handler written by hand, the best a user
// would write without a middleware: BEGIN; INSERT ... ON CONFLICT DO
// NOTHING RETURNING; the ledger write; the UPDATE storing the answer;
// COMMIT. A duplicate: BEGIN; the INSERT (no row); SELECT the stored
// answer; ROLLBACK. An in-flight duplicate waits in the INSERT.
func InlineHandler(db *sql.DB, table, ledger string) http.Handler {
	q := `"` + table + `"`
	claim := `INSERT INTO ` + q + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING RETURNING 1`
	lookup := `SELECT payload_digest, response_status, response_body FROM ` + q + `
WHERE source = $1 AND event_id = $2`
	complete := `UPDATE ` + q + `
SET response_status = $3, response_headers = $4, response_body = $5, completed_at = now()
WHERE source = $1 AND event_id = $2`
	const headers = `{"Content-Type": ["application/json"]}`
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		eventID := r.Header.Get(EventHeader)
		body, err := io.ReadAll(io.LimitReader(r.Body, idem.DefaultMaxBodyBytes))
		if err != nil || eventID == "" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		digest := sha256.Sum256(body)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			http.Error(w, "begin", http.StatusServiceUnavailable)
			return
		}
		defer func() { _ = tx.Rollback() }()
		var one int
		err = tx.QueryRowContext(ctx, claim, Source, eventID, digest[:]).Scan(&one)
		switch {
		case errors.Is(err, sql.ErrNoRows): // a duplicate: answer what is stored
			var (
				stored []byte
				status sql.NullInt32
				answer []byte
			)
			if err := tx.QueryRowContext(ctx, lookup, Source, eventID).Scan(&stored, &status, &answer); err != nil {
				http.Error(w, "lookup", http.StatusServiceUnavailable)
				return
			}
			_ = tx.Rollback()
			switch {
			case !status.Valid:
				http.Error(w, "in flight", http.StatusConflict)
			case subtle.ConstantTimeCompare(stored, digest[:]) != 1:
				http.Error(w, "payload mismatch", http.StatusUnprocessableEntity)
			default:
				w.Header().Set("Idempotent-Replayed", "true")
				WriteJSON(w, int(status.Int32), answer)
			}
			return
		case sqlState(err) == "55P03":
			http.Error(w, "in flight", http.StatusConflict)
			return
		case err != nil:
			http.Error(w, "claim", http.StatusServiceUnavailable)
			return
		}
		id, err := LedgerInsert(ctx, tx, ledger, eventID, body)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		answer := Answer(id, eventID)
		if _, err := tx.ExecContext(ctx, complete, Source, eventID, http.StatusCreated, headers, answer); err != nil {
			http.Error(w, "store", http.StatusServiceUnavailable)
			return
		}
		if err := tx.Commit(); err != nil {
			http.Error(w, "commit", http.StatusServiceUnavailable)
			return
		}
		WriteJSON(w, http.StatusCreated, answer)
	})
}

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}
