package idempgx

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgidem/idem"
)

// handleTx is the pgx.Tx a handler gets from Tx: the request's transaction,
// whose Commit and Rollback belong to the middleware, or a savepoint in it
// (Begin). The rest goes to pgx's transaction, begun in the claim's batch,
// and fails with pgx.ErrTxClosed once the middleware has ended it.
type handleTx struct {
	tx     pgx.Tx
	root   *handleTx // the request's handle; t itself at the top
	misuse string    // on the root: "Commit" or "Rollback", when the handler called it
	closed bool      // on the root: the middleware ended the transaction
}

func (t *handleTx) isClosed() bool { return t.root.closed }

// Commit releases a savepoint. On the request's transaction it refuses: the
// middleware commits it together with the stored answer. Nothing is sent;
// the request is then answered 500 and rolled back.
func (t *handleTx) Commit(ctx context.Context) error {
	if t != t.root && !t.isClosed() {
		return t.tx.Commit(ctx)
	}
	return t.refuse("Commit")
}

// Rollback rolls back to a savepoint, or refuses as Commit does.
func (t *handleTx) Rollback(ctx context.Context) error {
	if t != t.root && !t.isClosed() {
		return t.tx.Rollback(ctx)
	}
	return t.refuse("Rollback")
}

func (t *handleTx) refuse(what string) error {
	if t.isClosed() {
		return pgx.ErrTxClosed
	}
	if t.root.misuse == "" {
		t.root.misuse = what
	}
	return fmt.Errorf("%w: %s is the middleware's to call", idem.ErrTxMisuse, what)
}

// Begin makes a savepoint: a nested transaction within this one.
func (t *handleTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.isClosed() {
		return nil, pgx.ErrTxClosed
	}
	inner, err := t.tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &handleTx{tx: inner, root: t.root}, nil
}

func (t *handleTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.isClosed() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.tx.Exec(ctx, sql, args...)
}

func (t *handleTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.isClosed() {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Query(ctx, sql, args...)
}

func (t *handleTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.isClosed() {
		return errRow{pgx.ErrTxClosed}
	}
	return t.tx.QueryRow(ctx, sql, args...)
}

func (t *handleTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.isClosed() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.tx.SendBatch(ctx, b)
}

func (t *handleTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.isClosed() {
		return 0, pgx.ErrTxClosed
	}
	return t.tx.CopyFrom(ctx, table, columns, src)
}

func (t *handleTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.isClosed() {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Prepare(ctx, name, sql)
}

// LargeObjects returns pgx's large objects of the transaction, for use
// while the handler runs only, as Conn.
func (t *handleTx) LargeObjects() pgx.LargeObjects { return t.tx.LargeObjects() }

// Conn returns the connection the transaction runs on, for use while the
// handler runs only: afterwards it serves other requests.
func (t *handleTx) Conn() *pgx.Conn { return t.tx.Conn() }

// errRow is a pgx.Row that fails with err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
