// Package idempgx puts idem in front of handlers that use a pgx pool
// (github.com/jackc/pgx/v5/pgxpool): the handler gets a pgx.Tx, so
// sqlc-generated queries in pgx/v5 mode take it with WithTx(tx).
//
// It is the same middleware as idem.New's, on the same table, with the same
// Options and the same answers: instances of both can serve one table side
// by side. What differs is the wire: BEGIN goes with the claim, the answer
// with COMMIT, so a one-statement handler's new event costs 3 round trips
// where database/sql needs 5.
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	err = idempgx.Migrate(ctx, pool, "")
//	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Stripe(secret)})
//	mux.Handle("POST /webhooks/stripe", mw.Handler(handler))
//	// in the handler:
//	tx, ok := idempgx.Tx(r.Context())
//	_, err := queries.WithTx(tx).RecordPayment(ctx, ...)
package idempgx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/connstr"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// New validates opts and returns a middleware that claims keys in the
// database of pool, where Migrate has created the table. Every field of
// opts means what it means for idem.New; TxOptions' isolation level and
// read-only flag become the BEGIN statement. New does not touch the
// database: a database that is down answers 503 per request. With
// TxOptions nil, the transactions are READ COMMITTED, stated in their BEGIN
// whatever the server's default_transaction_isolation: the claim is built
// for it. New warns (opts.Logger) of a pool whose connection string names
// several hosts without connect_timeout (docs/ha.md).
func New(pool *pgxpool.Pool, opts idem.Options) (*idem.Middleware, error) {
	if pool == nil {
		return nil, errors.New("idem: idempgx.New needs a *pgxpool.Pool")
	}
	mw, err := driver.NewMiddleware(pgxPool{pool, int(pool.Config().MaxConns)}, opts)
	if err != nil {
		return nil, err
	}
	connstr.Warn(opts.Logger, &pool.Config().ConnConfig.Config)
	return mw.(*idem.Middleware), nil
}

// Tx returns the transaction that holds the claim of the current request
// (or call of Middleware.Do), for the handler's writes: they commit
// together with the claim and the stored answer, or roll back with them.
// The middleware owns it: Commit and Rollback return an error wrapping
// idem.ErrTxMisuse and send nothing, and the request is then answered 500
// and rolled back. Begin makes a savepoint, as pgx's own nested
// transactions do. ok is false outside a request or Do of an idempgx
// middleware.
func Tx(ctx context.Context) (tx pgx.Tx, ok bool) {
	h, ok := driver.HandleFromContext(ctx)
	if !ok {
		return nil, false
	}
	tx, ok = h.(*handleTx)
	return tx, ok
}

// Migrate is idem.Migrate through pool: the table and its index, if new.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table string) error {
	return MigrateWith(ctx, pool, idem.MigrateOptions{Table: table})
}

// MigrateWith is idem.MigrateWith through pool: with
// opts.PartitionInterval set, it creates the table partitioned
// (docs/partitioning.md).
func MigrateWith(ctx context.Context, pool *pgxpool.Pool, opts idem.MigrateOptions) error {
	db := stdlib.OpenDBFromPool(pool) // closing it leaves the pool open
	defer db.Close()
	return idem.MigrateWith(ctx, db, opts)
}

// pgxPool is the pgx adapter (driver.Pool): each batch is one pipelined
// round trip, on a connection held from a claim's BEGIN to its end. It
// decides nothing: package claims does.
type pgxPool struct {
	pool *pgxpool.Pool
	cap  int
}

func (p pgxPool) Acquire(ctx context.Context) (driver.Conn, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &pgxConn{conn: conn, c: conn.Conn()}, nil
}

func (p pgxPool) Pipelines() bool { return true }

func (p pgxPool) Cap() int { return p.cap }

func (p pgxPool) Query(ctx context.Context, query string, args []any, each func(func(...any) error) error) error {
	rows, _ := p.pool.Query(ctx, query, args...) // its error is rows.Err()'s too
	defer rows.Close()
	return summary.EachRow(rows, each)
}

// pgxConn is a connection held from Acquire to Close.
type pgxConn struct {
	conn *pgxpool.Conn
	c    *pgx.Conn
	h    *handleTx // what the handler gets, made by the BEGIN
	open bool      // a transaction is open on c
	done bool      // closed: the connection is back in the pool
}

func (t *pgxConn) Handle() any { return t.h }

// Send sends b as one batch: BEGIN (pgx's Batch.BeginTx, whose pgx.Tx the
// handler's handle wraps), the statements, then COMMIT or ROLLBACK.
func (t *pgxConn) Send(ctx context.Context, b *driver.Batch) error {
	var pb pgx.Batch
	if b.Begin != nil {
		pb.BeginTx(txOptions(b.Begin))
	}
	for _, s := range b.Stmts {
		pb.Queue(s.SQL, s.Args...)
	}
	end := ""
	switch {
	case b.Commit:
		if err := t.canCommit(ctx); err != nil {
			return err
		}
		// Never cancelled (pgx would); the engine stops waiting at its
		// deadline. COMMIT when open, or opened by this batch.
		ctx = context.WithoutCancel(ctx)
		if t.open || b.Begin != nil {
			end = "COMMIT"
		}
	case b.Rollback:
		end = "ROLLBACK"
	}
	if end != "" {
		pb.Queue(end)
	}
	br := t.c.SendBatch(ctx, &pb)
	err := t.read(br, b, end)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// read reads the results of a batch that Send sent.
func (t *pgxConn) read(br pgx.BatchResults, b *driver.Batch, end string) error {
	if b.Begin != nil {
		t.h = &handleTx{tx: br.Tx()}
		t.h.root = t.h
		if _, err := br.Exec(); err != nil {
			return err
		}
		t.open = true
	}
	for i := range b.Stmts {
		s, err := &b.Stmts[i], error(nil)
		if s.Dest == nil {
			var tag pgconn.CommandTag
			tag, err = br.Exec()
			s.N = tag.RowsAffected()
		} else if err = br.QueryRow().Scan(s.Dest...); errors.Is(err, pgx.ErrNoRows) {
			s.NoRow, err = true, nil
		}
		if err != nil {
			return err
		}
	}
	switch end {
	case "":
		return nil
	case "ROLLBACK":
		_, err := br.Exec()
		t.open = t.open && err != nil
		return err
	}
	stop := watchCommit(t.c.PgConn()) // what is read from here on answers COMMIT
	tag, err := br.Exec()
	warned := stop()
	t.open = false
	switch {
	case err != nil:
		return err
	case tag.String() != "COMMIT": // a statement failed earlier
		return fmt.Errorf("idem: COMMIT answered %q: %w", tag.String(), pgx.ErrTxCommitRollback)
	}
	return warned // committed, but with a WARNING (DetectUnreplicatedCommits)
}

// canCommit refuses to commit a transaction the handler ended, or tried to
// end, itself: a COMMIT now would store the answer outside it.
func (t *pgxConn) canCommit(ctx context.Context) error {
	if t.h != nil && t.h.misuse != "" {
		return fmt.Errorf("%w: the handler called %s on the request's transaction", driver.ErrTxDone, t.h.misuse)
	}
	if t.open && t.c.PgConn().TxStatus() == 'I' {
		return fmt.Errorf("%w: %w: the handler sent COMMIT or ROLLBACK itself", driver.ErrTxDone, driver.ErrTxEnded)
	}
	return ctx.Err() // the deadline passed before the answer could be stored
}

// Close rolls back whatever is open and gives the connection back to the
// pool (which closes it if it is still in a transaction).
func (t *pgxConn) Close(ctx context.Context) error {
	if t.done {
		return nil
	}
	var err error
	switch {
	case t.open && t.c.IsClosed(): // it died (a failover, a killed backend): rolled back
		err = fmt.Errorf("%w: pgx closed it", driver.ErrConnLost)
	case t.open && t.c.PgConn().TxStatus() != 'I':
		// Bounded, after the request's own deadline: past it the
		// connection is closed, which rolls back too.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		err = t.h.tx.Rollback(rctx)
		cancel()
		if driver.ConnLost(err) || errors.Is(err, pgconn.ErrConnClosed) { // not "conn busy" on a live one
			err = fmt.Errorf("%w: %w", driver.ErrConnLost, err)
		}
	}
	t.done = true
	if t.h != nil {
		t.h.closed = true
	}
	t.conn.Release()
	return err
}

// txOptions are pgx's options for database/sql's, which package claims
// has validated (driver.IsoLevel).
func txOptions(opts *sql.TxOptions) pgx.TxOptions {
	iso, _ := driver.IsoLevel(opts)
	o := pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(iso)}
	if opts.ReadOnly {
		o.AccessMode = pgx.ReadOnly
	}
	return o
}
