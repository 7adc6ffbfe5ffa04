package driver

import (
	"context"
	"database/sql"
	"fmt"
)

// Pool is what an adapter implements: how statements travel to the
// database on its connection pool, and nothing else. Every decision (which
// statements, in which order, in which transaction, and what their results
// mean) is package claims', written once for both adapters.
type Pool interface {
	// Acquire takes a connection for a sequence of batches: a claim's
	// transaction from its BEGIN to its end. Waiting for one ends with
	// ctx. An adapter may take the connection only when a batch needs it.
	Acquire(ctx context.Context) (Conn, error)
	// Query runs query outside any transaction and calls each with every
	// row's Scan.
	Query(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error
	// Pipelines reports whether a batch travels in one round trip (pgx);
	// otherwise each statement, BEGIN and COMMIT is a round trip of its own
	// (database/sql).
	Pipelines() bool
	// Cap is the pool's connection cap, 0 for none.
	Cap() int
}

// Conn is one connection of a Pool, held from Acquire to Close.
type Conn interface {
	// Send sends b: BEGIN first when b.Begin is set, then b.Stmts in order,
	// then b.End; in one round trip when the Pool pipelines. It reads each
	// statement's result into it. The first error stops it; statements
	// after it are not run (a transaction is then aborted). An adapter
	// returns an error wrapping ErrTxDone when the handler ended the
	// transaction (or tried to), wrapping ErrTxEnded too when it really did.
	Send(ctx context.Context, b *Batch) error
	// Close rolls back the transaction still open, if any, and gives the
	// connection back. It is safe to call more than once.
	Close(ctx context.Context) error
	// Handle is what a handler gets for the open transaction: a *sql.Tx or
	// a pgx.Tx.
	Handle() any
}

// Batch is what Conn.Send sends.
type Batch struct {
	// Begin, when not nil, begins a transaction with these options before
	// the statements (IsoLevel gives the level's name).
	Begin *sql.TxOptions
	Stmts []Stmt
	// Commit ends the batch by committing: with COMMIT when a transaction
	// is open, or by the statements themselves when none is. A commit is
	// never cancelled once sent: a COMMIT waiting for a synchronous standby
	// that is cancelled commits locally, unreplicated, and answers
	// success. So an adapter checks ctx first and then sends what commits
	// on a context that does not end; the engine stops waiting at its
	// deadline instead.
	Commit bool
	// Rollback ends the batch with ROLLBACK (ignored with Commit).
	Rollback bool
}

// Stmt is one statement of a Batch and, once sent, its result.
type Stmt struct {
	SQL  string
	Args []any
	// Dest are the destinations of the statement's one row. Nil: the
	// statement returns no row, and N is how many it changed.
	Dest []any
	// NoRow: Dest was set and the statement returned no row (Dest is then
	// untouched).
	NoRow bool
	N     int64
}

// IsoLevel is PostgreSQL's name of the isolation level of opts
// ("read committed"), "" for the server's default; an error for a level
// PostgreSQL does not have.
func IsoLevel(opts *sql.TxOptions) (string, error) {
	if opts == nil {
		return "", nil
	}
	switch opts.Isolation {
	case sql.LevelDefault:
		return "", nil
	case sql.LevelReadUncommitted:
		return "read uncommitted", nil
	case sql.LevelReadCommitted:
		return "read committed", nil
	case sql.LevelRepeatableRead, sql.LevelSnapshot:
		return "repeatable read", nil
	case sql.LevelSerializable:
		return "serializable", nil
	}
	return "", fmt.Errorf("idem: Options.TxOptions: isolation level %v is not supported by PostgreSQL", opts.Isolation)
}
