package idempgx

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgidem/idem"
)

// handleTx is the pgx.Tx a handler gets from Tx: the request's transaction,
// whose Commit and Rollback belong to the middleware. Everything else goes
// to pgx's own transaction, begun in the claim's batch; Begin makes pgx's
// savepoint-backed nested transaction.
type handleTx struct {
	tx     pgx.Tx
	misuse string // "Commit" or "Rollback", when the handler called it
	closed bool   // the middleware ended the transaction
}

// Commit refuses: the middleware commits the request's transaction together
// with the stored answer. Nothing is sent; the request is then answered 500
// and rolled back.
func (t *handleTx) Commit(context.Context) error { return t.refuse("Commit") }

// Rollback refuses, as Commit does.
func (t *handleTx) Rollback(context.Context) error { return t.refuse("Rollback") }

func (t *handleTx) refuse(what string) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	if t.misuse == "" {
		t.misuse = what
	}
	return fmt.Errorf("%w: %s is the middleware's to call", idem.ErrTxMisuse, what)
}

// Begin makes a savepoint: a nested transaction within the request's.
func (t *handleTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Begin(ctx)
}

func (t *handleTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.tx.Exec(ctx, sql, args...)
}

func (t *handleTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Query(ctx, sql, args...)
}

func (t *handleTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return t.tx.QueryRow(ctx, sql, args...)
}

func (t *handleTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.tx.SendBatch(ctx, b)
}

func (t *handleTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed {
		return 0, pgx.ErrTxClosed
	}
	return t.tx.CopyFrom(ctx, table, columns, src)
}

func (t *handleTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Prepare(ctx, name, sql)
}

func (t *handleTx) LargeObjects() pgx.LargeObjects { return t.tx.LargeObjects() }

func (t *handleTx) Conn() *pgx.Conn { return t.tx.Conn() }

// errRow is a pgx.Row that fails with err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
