// Package idempgx puts idem in front of handlers that use a pgx pool
// (github.com/jackc/pgx/v5/pgxpool): the handler gets a pgx.Tx, so
// sqlc-generated queries in pgx/v5 mode take it with WithTx(tx).
//
// It is the same middleware as idem.New's, on the same table, with the same
// Options and the same answers: instances of both can serve one table side
// by side. What differs is the wire: pgx sends BEGIN in one round trip with
// the claim, and the stored answer in one round trip with COMMIT, so a new
// event whose handler runs one statement costs 3 round trips where
// database/sql needs 5.
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	...
//	if err := idempgx.Migrate(ctx, pool, ""); err != nil { ... }
//	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Stripe()})
//	...
//	mux.Handle("POST /webhooks/stripe", mw.Handler(handler))
//
// In the handler:
//
//	tx, ok := idempgx.Tx(r.Context())
//	if !ok { ... }
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
	"github.com/pgidem/idem/internal/driver"
)

// New validates opts and returns a middleware that claims keys in the
// database of pool, where Migrate has created the table. Every field of
// opts means what it means for idem.New; TxOptions' isolation level and
// read-only flag become the BEGIN statement. New does not touch the
// database: a database that is down answers 503 per request. With
// TxOptions nil, the transactions are READ COMMITTED, stated in their BEGIN
// whatever the server's default_transaction_isolation: the claim is built
// for it.
func New(pool *pgxpool.Pool, opts idem.Options) (*idem.Middleware, error) {
	if pool == nil {
		return nil, errors.New("idem: idempgx.New needs a *pgxpool.Pool")
	}
	begin, err := txOptions(opts.TxOptions)
	if err != nil {
		return nil, err
	}
	poolCap := int(pool.Config().MaxConns)
	lockFirst := begin.IsoLevel == "" || begin.IsoLevel == pgx.ReadCommitted || begin.IsoLevel == pgx.ReadUncommitted
	if begin.IsoLevel == "" {
		// The lock-first claim needs READ COMMITTED (a statement's snapshot
		// taken after the lock): say so, whatever the server's
		// default_transaction_isolation.
		begin.IsoLevel = pgx.ReadCommitted
	}
	mw, err := driver.NewMiddleware(func(q driver.Queries) driver.Driver {
		return &pgxDriver{pool: pool, q: q, begin: begin, poolCap: poolCap, lockFirst: lockFirst}
	}, opts)
	if err != nil {
		return nil, err
	}
	return mw.(*idem.Middleware), nil
}

// Tx returns the transaction that holds the claim of the current request,
// for the handler's writes: they commit together with the claim and the
// stored answer, or roll back with them. The middleware owns it: Commit and
// Rollback return an error wrapping idem.ErrTxMisuse and send nothing, and
// the request is then answered 500 and rolled back. Begin makes a savepoint,
// as pgx's own nested transactions do. ok is false outside a request of an
// idempgx middleware.
func Tx(ctx context.Context) (tx pgx.Tx, ok bool) {
	h, ok := driver.HandleFromContext(ctx)
	if !ok {
		return nil, false
	}
	tx, ok = h.(*handleTx)
	return tx, ok
}

// Migrate creates the idempotency table and its index if they do not
// exist, as idem.Migrate does, through pool.
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

// txOptions are pgx's options for database/sql's, as pgx's database/sql
// driver maps them.
func txOptions(opts *sql.TxOptions) (pgx.TxOptions, error) {
	var o pgx.TxOptions
	if opts == nil {
		return o, nil
	}
	switch opts.Isolation {
	case sql.LevelDefault:
	case sql.LevelReadUncommitted:
		o.IsoLevel = pgx.ReadUncommitted
	case sql.LevelReadCommitted:
		o.IsoLevel = pgx.ReadCommitted
	case sql.LevelRepeatableRead, sql.LevelSnapshot:
		o.IsoLevel = pgx.RepeatableRead
	case sql.LevelSerializable:
		o.IsoLevel = pgx.Serializable
	default:
		return o, fmt.Errorf("idem: Options.TxOptions: isolation level %v is not supported by PostgreSQL", opts.Isolation)
	}
	if opts.ReadOnly {
		o.AccessMode = pgx.ReadOnly
	}
	return o, nil
}

// rollbackTimeout bounds a ROLLBACK sent after the request's own deadline
// has passed; past it the connection is closed, which rolls back too.
const rollbackTimeout = 5 * time.Second

// pgxDriver is the pgx adapter: each operation is one pipelined batch where
// it can be (BEGIN with the claim and the lookup; the stored answer with
// COMMIT), on a connection held from Begin to Commit or Rollback.
type pgxDriver struct {
	pool    *pgxpool.Pool
	q       driver.Queries
	begin   pgx.TxOptions
	poolCap int
	// lockFirst: at READ COMMITTED (the default), a claim takes the key's
	// lock and reads its row, and the completed row is inserted at the end,
	// with the answer. Under REPEATABLE READ or SERIALIZABLE a statement's
	// snapshot can predate the lock, so the claim inserts the key first and
	// the answer is an UPDATE, as on database/sql; a partitioned table
	// (found out on the first claim) refuses such claims.
	lockFirst bool
	layout    driver.Layout
}

func (d *pgxDriver) PoolCap() int { return d.poolCap }

// Begin claims the key in a transaction begun in the same round trip. At
// READ COMMITTED: BEGIN, the key's lock taken without waiting, and its row
// read by a statement of its own (so it sees rows committed before the lock
// was taken); a new event needs no more until the answer. Otherwise: BEGIN
// and the claim's INSERT, then, for a duplicate, the lookup with ROLLBACK.
// Either way a first replay costs two round trips.
func (d *pgxDriver) Begin(ctx context.Context, a *driver.Args) (driver.Tx, driver.Begun, error) {
	if !d.lockFirst {
		if err := d.refusePartitioned(ctx); err != nil {
			return nil, driver.Begun{}, err
		}
	}
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, driver.Begun{}, err
	}
	t := &claimTx{d: d, conn: conn, c: conn.Conn()}
	var begun driver.Begun
	if d.lockFirst {
		begun, err = t.lockAndRead(ctx, a)
	} else {
		begun.Won, err = t.insertClaim(ctx, a)
		if err == nil && !begun.Won {
			begun.Row, err = t.lookupAndEnd(ctx, a)
		}
	}
	if err != nil {
		if sqlState(err) == driver.NoConflictTarget {
			d.layout.Forget() // the table became partitioned: ask again
		}
		_ = t.Rollback(ctx)
		return nil, driver.Begun{}, err
	}
	return t, begun, nil
}

// refusePartitioned fails claims that insert the key first on a
// partitioned table, where ON CONFLICT sees one partition only and the
// snapshot of REPEATABLE READ or SERIALIZABLE predates the key's lock. At
// READ COMMITTED the lock-first claim serves both layouts, unasked.
func (d *pgxDriver) refusePartitioned(ctx context.Context) error {
	partitioned, err := d.layout.Partitioned(ctx, func(ctx context.Context) (*bool, error) {
		var p *bool
		err := d.pool.QueryRow(ctx, driver.PartitionedSQL, d.q.Table).Scan(&p)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, nil
		}
		return p, err
	})
	if err == nil && partitioned {
		err = driver.ErrPartitionedIsolation
	}
	return err
}

// lockAndRead takes the key's lock without waiting and reads its row, in
// the open transaction or a new one begun in the same round trip. The key
// is won when the lock is taken and there is no row: the completed row is
// then inserted by Commit.
func (t *claimTx) lockAndRead(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) {
		b.Queue(t.d.q.TryLock, a.Lock)
		b.Queue(t.d.q.Read, a.Source, a.EventID)
	})
	var begun driver.Begun
	if err == nil {
		err = br.QueryRow().Scan(&begun.Row.GotLock)
	}
	if err == nil {
		begun.Row, err = scanRead(br.QueryRow(), begun.Row)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	begun.Won = err == nil && begun.Row.GotLock && !begun.Row.Visible
	t.insertAtEnd = begun.Won
	return begun, err
}

// insertClaim inserts the claim, in the open transaction or a new one begun
// in the same round trip.
func (t *claimTx) insertClaim(ctx context.Context, a *driver.Args) (bool, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.d.q.Claim, a.Source, a.EventID, a.Digest, a.Lock) })
	var won bool
	if err == nil {
		err = br.QueryRow().Scan(&won)
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return won, err
}

// lookupAndEnd reads the key's row and ends the transaction in one round
// trip; if the key is in flight, the wait begins a new one.
func (t *claimTx) lookupAndEnd(ctx context.Context, a *driver.Args) (driver.Row, error) {
	var b pgx.Batch
	b.Queue(t.d.q.Lookup, a.Source, a.EventID, a.Lock)
	b.Queue("ROLLBACK")
	br := t.c.SendBatch(ctx, &b)
	row, err := scanRow(br.QueryRow(), nil)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		t.open = false
	}
	return row, err
}

// scanRead reads the Read statement's row into row; no row is Visible false.
func scanRead(r pgx.Row, row driver.Row) (driver.Row, error) {
	var status *int32
	err := r.Scan(&row.Digest, &status, &row.Headers, &row.Body, &row.Completed)
	if errors.Is(err, pgx.ErrNoRows) {
		return row, nil
	}
	if err != nil {
		return row, err
	}
	row.Visible = true
	if status != nil {
		row.Status = int(*status)
	}
	return row, nil
}

// scanRow reads a lookup's row; extra receives a trailing column.
func scanRow(r pgx.Row, extra any) (driver.Row, error) {
	var (
		c      driver.Row
		status *int32
	)
	dest := []any{&c.GotLock, &c.Digest, &status, &c.Headers, &c.Body, &c.Completed}
	if extra != nil {
		dest = append(dest, extra)
	}
	if err := r.Scan(dest...); err != nil {
		return c, err
	}
	c.Visible = c.Digest != nil
	if status != nil {
		c.Status = int(*status)
	}
	return c, nil
}

// claimTx is the claim's transaction, on a connection held from Begin to
// Commit or Rollback.
type claimTx struct {
	d    *pgxDriver
	conn *pgxpool.Conn
	c    *pgx.Conn
	h    *handleTx // what the handler gets
	open bool      // a transaction is open on c
	done bool      // committed or rolled back, connection released
	// insertAtEnd: the key was won lock-first; Commit inserts its row.
	insertAtEnd bool
}

// send sends a batch of the statements that queue adds, with BEGIN in
// front when no transaction is open, and reads BEGIN's result. The caller
// reads the rest and closes the results.
func (t *claimTx) send(ctx context.Context, queue func(*pgx.Batch)) (pgx.BatchResults, error) {
	var b pgx.Batch
	begins := !t.open
	if begins {
		b.BeginTx(t.d.begin)
	}
	queue(&b)
	br := t.c.SendBatch(ctx, &b)
	if !begins {
		return br, nil
	}
	t.h = newHandle(br.Tx())
	if _, err := br.Exec(); err != nil {
		return br, err
	}
	t.open = true
	return br, nil
}

func (t *claimTx) Handle() any { return t.h }

// Claim claims the key in this transaction, which holds the key's lock and
// has found no row. At READ COMMITTED that is the claim: nothing is sent,
// and Commit inserts the completed row. Otherwise the claim's INSERT is
// sent, in the open transaction or a new one begun in the same round trip.
func (t *claimTx) Claim(ctx context.Context, a *driver.Args) (bool, error) {
	if t.d.lockFirst {
		t.insertAtEnd = true
		return true, nil
	}
	return t.insertClaim(ctx, a)
}

// Wait waits for the key's lock, in the open transaction or in a new one
// begun in the same round trip.
func (t *claimTx) Wait(ctx context.Context, lock int64, d time.Duration) (string, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.d.q.Wait, lock, driver.LockTimeout(d)) })
	var old string
	if err == nil {
		var locked *string
		err = br.QueryRow().Scan(&old, &locked)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return old, err
}

func (t *claimTx) LookupRestoring(ctx context.Context, a *driver.Args, lockTimeout string) (driver.Row, error) {
	var restored string
	return scanRow(t.c.QueryRow(ctx, t.d.q.LookupRestoring, a.Source, a.EventID, a.Lock, lockTimeout), &restored)
}

// Commit sends the stored answer and COMMIT in one round trip. The answer
// is the key's completed row, inserted (a key won lock-first; the primary
// key refuses a second row), or an UPDATE of the claim that fails when it
// finds no claim to complete; either way the COMMIT behind it cannot commit
// the handler's writes without their answer. A COMMIT that comes back as
// ROLLBACK (a statement failed earlier) is an error.
func (t *claimTx) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	if m := t.h.misuse; m != "" {
		return fmt.Errorf("%w: the handler called %s on the request's transaction", driver.ErrTxDone, m)
	}
	if t.c.PgConn().TxStatus() == 'I' {
		// The handler ended the transaction with COMMIT or ROLLBACK of its
		// own: a COMMIT now would store the answer outside it.
		return fmt.Errorf("%w: the handler sent COMMIT or ROLLBACK itself", driver.ErrTxDone)
	}
	var b pgx.Batch
	if t.insertAtEnd {
		b.Queue(t.d.q.InsertCompleted, a.Source, a.EventID, a.Digest, status, string(headers), body)
	} else {
		b.Queue(t.d.q.CompleteOrFail, a.Source, a.EventID, status, string(headers), body)
	}
	b.Queue("COMMIT")
	br := t.c.SendBatch(ctx, &b)
	_, err := br.Exec()
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	switch {
	case sqlState(err) == "22012": // the division by a count of zero
		return fmt.Errorf("%w: %w", driver.ErrNotStored, err)
	case err != nil:
		return err
	case tag.String() != "COMMIT":
		return fmt.Errorf("idem: COMMIT answered %q: %w", tag.String(), pgx.ErrTxCommitRollback)
	}
	t.release()
	return nil
}

// Rollback rolls back whatever is open and gives the connection back.
func (t *claimTx) Rollback(ctx context.Context) error {
	if t.done {
		return nil
	}
	var err error
	if t.open && !t.c.IsClosed() && t.c.PgConn().TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		err = t.h.tx.Rollback(rctx)
		cancel()
	}
	t.release()
	return err
}

// release gives the connection back to the pool (which closes it if it is
// still in a transaction) and closes the handler's handle.
func (t *claimTx) release() {
	t.done = true
	t.h.closed = true
	t.conn.Release()
}

// sqlState returns the SQLSTATE of a PostgreSQL error, or "".
func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}
