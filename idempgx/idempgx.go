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
//	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Stripe(secret)})
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
	"github.com/pgidem/idem/internal/summary"
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
	sum       summary.Lazy // of a partitioned table's past partitions
}

func (d *pgxDriver) PoolCap() int { return d.poolCap }

// Begin claims the key in a transaction begun in the same round trip. At
// READ COMMITTED: BEGIN, the key's lock taken without waiting, and its row
// read by a statement of its own (so it sees rows committed before the lock
// was taken); a new event needs no more until the answer. Otherwise: BEGIN
// and the claim's INSERT, then, for a duplicate, the lookup with ROLLBACK.
// Either way a first replay costs two round trips.
//
// On a partitioned table with summaries of its past partitions
// (summary.Summaries), a key whose answer is in one of them is answered by
// one statement, outside any transaction; any other claims on the current
// partition, looking in the past partitions that may hold the key first.
func (d *pgxDriver) Begin(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	partitioned := false
	if !d.lockFirst {
		if err := d.refusePartitioned(ctx); err != nil {
			return driver.Begun{}, err
		}
	} else if p, err := d.layout.Partitioned(ctx, d.askPartitioned); err != nil {
		return driver.Begun{}, err
	} else if partitioned = p; p {
		if row, ok, err := d.Summaries().Answered(ctx, a, time.Now()); ok || err != nil {
			return driver.Begun{Answered: ok, Row: row}, err // answered from a past partition, without a transaction
		}
	}
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return driver.Begun{}, err
	}
	t := &claimTx{d: d, q: &d.q, conn: conn, c: conn.Conn()}
	var begun driver.Begun
	if partitioned {
		if t.current = d.Summaries().Fast(a, time.Now()); t.current != nil {
			t.q = &t.current.Queries
		}
		if t.current != nil && t.q.ClaimPast != "" {
			begun, err = t.claimPast(ctx, a)
		} else {
			begun, err = t.lockAndRead(ctx, a)
		}
		if t.current != nil && summary.ClaimAgainEverywhere(err) {
			// Begun outside the current partition, or a partition gone
			// since the last listing: claim lock-first across the
			// partitions, in a new transaction.
			if _, err = t.c.Exec(ctx, "ROLLBACK"); err == nil {
				t.open, t.q, t.current = false, &d.q, nil
				begun, err = t.lockAndRead(ctx, a)
			}
		}
	} else if d.lockFirst {
		begun, err = t.lockAndRead(ctx, a)
	} else {
		begun.Won, err = t.insertClaim(ctx, a)
		if err == nil && !begun.Won {
			begun.Row, err = t.lookupAndEnd(ctx, a)
		}
	}
	if err != nil {
		if driver.SQLState(err) == driver.NoConflictTarget {
			d.layout.Forget() // the table became partitioned: ask again
		}
		_ = t.Rollback(ctx)
		return driver.Begun{}, err
	}
	begun.Tx = t
	return begun, nil
}

// refusePartitioned fails claims that insert the key first on a
// partitioned table, where ON CONFLICT sees one partition only and the
// snapshot of REPEATABLE READ or SERIALIZABLE predates the key's lock. At
// READ COMMITTED the lock-first claim serves both layouts, unasked.
func (d *pgxDriver) refusePartitioned(ctx context.Context) error {
	partitioned, err := d.layout.Partitioned(ctx, d.askPartitioned)
	if err == nil && partitioned {
		err = driver.ErrPartitionedIsolation
	}
	return err
}

// askPartitioned asks whether the table is partitioned; nil when it does
// not exist.
func (d *pgxDriver) askPartitioned(ctx context.Context) (*bool, error) {
	var p *bool
	err := d.pool.QueryRow(ctx, driver.PartitionedSQL, d.q.Table).Scan(&p)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	return p, err
}

// Summaries are those of d's table, if partitioned.
func (d *pgxDriver) Summaries() *summary.Summaries { return d.sum.Get(d.q.Table, d.query) }

// query is the summary.Querier of the summaries.
func (d *pgxDriver) query(ctx context.Context, query string, args []any, each func(func(...any) error) error) error {
	rows, err := d.pool.Query(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return summary.EachRow(rows, each)
}

// lockAndRead takes the key's lock without waiting and reads its row, in
// the open transaction or a new one begun in the same round trip. The key
// is won when the lock is taken and there is no row: the completed row is
// then inserted by Commit.
func (t *claimTx) lockAndRead(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	lock := t.q.TryLock
	if t.current != nil {
		lock = summary.TryLockAt
	}
	br, err := t.send(ctx, func(b *pgx.Batch) {
		b.Queue(lock, a.Lock)
		b.Queue(t.q.Read, a.Source, a.EventID)
	})
	var (
		begun driver.Begun
		s     driver.Scan
	)
	if err == nil && t.current != nil {
		var began time.Time
		if err = br.QueryRow().Scan(&s.Locked, &began); err == nil && !t.current.Holds(began) {
			err = summary.ErrOutside
		}
	} else if err == nil {
		err = br.QueryRow().Scan(&s.Locked)
	}
	if err == nil {
		// No row: the key has none (Scan untouched).
		if begun.Row, err = s.Read(br.QueryRow().Scan); errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	begun.Won = err == nil && begun.Row.State == driver.Free
	t.insertAtEnd = begun.Won
	return begun, err
}

// claimPast claims the key on the current partition with ClaimPast, in a
// transaction begun in the same round trip: a key that some past
// partitions may hold, which the statement looks for there first. A
// completed row found there is the answer; otherwise, when nothing was
// inserted, the lookup reads the key's row in the current partition and
// those, and its lock. A key won is inserted now, and its answer stored by
// an UPDATE.
func (t *claimTx) claimPast(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.q.ClaimPast, a.Source, a.EventID, a.Digest, a.Lock) })
	var (
		begun driver.Begun
		began time.Time
		s     driver.Scan // the lock does not matter: the lookup reads it
	)
	if err == nil {
		begun.Row, err = s.Read(br.QueryRow().Scan, &begun.Won, &began)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil || begun.Won || begun.Row.State == driver.Completed {
		return begun, err
	}
	if !t.current.Holds(began) {
		return begun, summary.ErrOutside
	}
	begun.Row, err = driver.Lookup(t.c.QueryRow(ctx, t.q.Lookup, a.Source, a.EventID, a.Lock).Scan)
	return begun, err
}

// insertClaim inserts the claim, in the open transaction or a new one begun
// in the same round trip.
func (t *claimTx) insertClaim(ctx context.Context, a *driver.Args) (bool, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.q.Claim, a.Source, a.EventID, a.Digest, a.Lock) })
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
	b.Queue(t.q.Lookup, a.Source, a.EventID, a.Lock)
	b.Queue("ROLLBACK")
	br := t.c.SendBatch(ctx, &b)
	row, err := driver.Lookup(br.QueryRow().Scan)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		t.open = false
	}
	return row, err
}

// claimTx is the claim's transaction, on a connection held from Begin to
// Commit or Rollback.
type claimTx struct {
	d       *pgxDriver
	q       *driver.Queries  // d's, or current's
	current *summary.Current // a partitioned table's current partition, claimed on as a plain table
	conn    *pgxpool.Conn
	c       *pgx.Conn
	h       *handleTx // what the handler gets
	open    bool      // a transaction is open on c
	done    bool      // committed or rolled back, connection released
	// insertAtEnd: the key was won lock-first; Commit inserts its row.
	insertAtEnd bool
}

// send sends a batch of the statements that queue adds, with BEGIN in
// front when no transaction is open, and reads BEGIN's result. The caller
// reads the rest and closes the results.
func (t *claimTx) send(ctx context.Context, queue func(*pgx.Batch)) (pgx.BatchResults, error) {
	return t.sendWith(ctx, t.d.begin, queue)
}

// sendWith is send, with BEGIN's options.
func (t *claimTx) sendWith(ctx context.Context, begin pgx.TxOptions, queue func(*pgx.Batch)) (pgx.BatchResults, error) {
	var b pgx.Batch
	begins := !t.open
	if begins {
		b.BeginTx(begin)
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
// begun in the same round trip, then reads the key's row with a statement
// of its own (its snapshot must come after the wait).
func (t *claimTx) Wait(ctx context.Context, a *driver.Args, d time.Duration) (driver.Row, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.q.Wait, a.Lock, driver.LockTimeout(d)) })
	var old string
	if err == nil {
		var locked *string
		err = br.QueryRow().Scan(&old, &locked)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return driver.Row{}, err
	}
	var restored string
	return driver.Lookup(t.c.QueryRow(ctx, t.q.LookupRestoring, a.Source, a.EventID, a.Lock, old).Scan, &restored)
}

// Commit sends the stored answer and COMMIT in one round trip. The answer
// is the key's completed row, inserted (a key won lock-first; the primary
// key refuses a second row), or an UPDATE of the claim that fails when it
// finds no claim to complete; either way the COMMIT behind it cannot commit
// the handler's writes without their answer. A COMMIT that comes back as
// ROLLBACK (a statement failed earlier) is an error.
func (t *claimTx) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	if t.insertAtEnd {
		return t.commitWith(ctx, driver.ErrNotStored, t.q.InsertCompleted, a.Source, a.EventID, a.Digest, status, string(headers), body)
	}
	return t.commitWith(ctx, driver.ErrNotStored, t.q.CompleteOrFail, a.Source, a.EventID, status, string(headers), body)
}

// Complete is the lease-mode commit: the answer, stored only if token still
// owns the key (else the statement fails, and so does the COMMIT behind
// it), and COMMIT, in one round trip.
func (t *claimTx) Complete(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	return t.commitWith(ctx, driver.ErrFenced, t.q.CompleteLeaseOrFail, a.Source, a.EventID, status, string(headers), body, token)
}

// commitWith sends the statement that stores the answer and COMMIT in one
// round trip; the statement fails with a division by zero when it stores
// nothing, and the error is then none.
func (t *claimTx) commitWith(ctx context.Context, none error, query string, args ...any) error {
	if m := t.h.misuse; m != "" {
		return fmt.Errorf("%w: the handler called %s on the request's transaction", driver.ErrTxDone, m)
	}
	if t.c.PgConn().TxStatus() == 'I' {
		// The handler ended the transaction with COMMIT or ROLLBACK of its
		// own: a COMMIT now would store the answer outside it.
		return fmt.Errorf("%w: %w: the handler sent COMMIT or ROLLBACK itself", driver.ErrTxDone, driver.ErrTxEnded)
	}
	if err := ctx.Err(); err != nil {
		return err // the deadline passed before the answer could be stored
	}
	var b pgx.Batch
	b.Queue(query, args...)
	b.Queue("COMMIT")
	// Never cancelled: when a context ends during a query, pgx sends a
	// CancelRequest (either context watcher: the default one closes the
	// connection, which sends it too), and a COMMIT waiting for a
	// synchronous standby that is cancelled commits locally, unreplicated,
	// answering success. The engine stops waiting at its deadline instead.
	br := t.c.SendBatch(context.WithoutCancel(ctx), &b)
	_, err := br.Exec()
	var (
		tag    pgconn.CommandTag
		warned error
	)
	if err == nil {
		stop := watchCommit(t.c.PgConn()) // what is read from here on answers COMMIT
		tag, err = br.Exec()
		warned = stop()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	switch {
	case driver.SQLState(err) == "22012": // the division by a count of zero
		return fmt.Errorf("%w: %w", none, err)
	case err != nil:
		return err
	case tag.String() != "COMMIT":
		return fmt.Errorf("idem: COMMIT answered %q: %w", tag.String(), pgx.ErrTxCommitRollback)
	}
	t.release()
	return warned // committed, but with a WARNING (DetectUnreplicatedCommits)
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

// TakeOver claims a key whose lease ran out: an UPDATE of its row, in the
// open transaction or in a new one begun in the same round trip (the
// statement takes the key's lock itself). The answer is then an UPDATE too.
func (t *claimTx) TakeOver(ctx context.Context, a *driver.Args) (bool, error) {
	br, err := t.send(ctx, func(b *pgx.Batch) { b.Queue(t.q.TakeOver, a.Source, a.EventID, a.Digest, a.Lock) })
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	won := err == nil && tag.RowsAffected() == 1
	if won {
		t.insertAtEnd = false
	}
	return won, err
}

// ClaimLease claims the key in lease mode: one statement, committed on its
// own; when it claims nothing, the lookup follows.
func (d *pgxDriver) ClaimLease(ctx context.Context, a *driver.Args, lease, wait time.Duration, token int64) (driver.Lease, error) {
	if partitioned, err := d.layout.Partitioned(ctx, d.askPartitioned); err != nil || partitioned {
		if err != nil {
			return driver.Lease{}, err
		}
		return d.claimLeaseLockFirst(ctx, a, lease, token)
	}
	var l driver.Lease
	err := d.pool.QueryRow(ctx, d.q.ClaimLease, a.Source, a.EventID, a.Digest, a.Lock, lease.Microseconds(), token, driver.LockTimeout(wait)).Scan(&l.TookOver)
	switch {
	case err == nil:
		l.Won, l.Token = true, token
		return l, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return l, err
	}
	l.Row, err = driver.Lookup(d.pool.QueryRow(ctx, d.q.Lookup, a.Source, a.EventID, a.Lock).Scan)
	return l, err
}

// claimLeaseLockFirst is the lease-mode claim on a partitioned table: BEGIN
// (READ COMMITTED) with the key's lock taken without waiting, then, with a
// new statement, the claim or the key's row (driver.Queries.ClaimLeaseOrRead)
// with COMMIT: two round trips; or, first, the key's answer read from a
// past partition (summary.Summaries.Answered).
func (d *pgxDriver) claimLeaseLockFirst(ctx context.Context, a *driver.Args, lease time.Duration, token int64) (driver.Lease, error) {
	if row, ok, err := d.Summaries().Answered(ctx, a, time.Now()); ok || err != nil {
		return driver.Lease{Row: row}, err // answered from a past partition, without a transaction
	}
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return driver.Lease{}, err
	}
	t := &claimTx{d: d, q: &d.q, conn: conn, c: conn.Conn()}
	defer func() { _ = t.Rollback(ctx) }()
	var s driver.Scan
	br, err := t.sendWith(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(b *pgx.Batch) { b.Queue(d.q.TryLock, a.Lock) })
	if err == nil {
		err = br.QueryRow().Scan(&s.Locked)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return driver.Lease{}, err
	}
	var b pgx.Batch
	b.Queue(d.q.ClaimLeaseOrRead, a.Source, a.EventID, a.Digest, s.Locked, lease.Microseconds(), token)
	b.Queue("COMMIT")
	br = t.c.SendBatch(context.WithoutCancel(ctx), &b) // a COMMIT is never cancelled (commitWith)
	var (
		l    driver.Lease
		took *bool
	)
	l.Row, err = s.Read(br.QueryRow().Scan, &took)
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return driver.Lease{}, err
	}
	t.open = false
	if took != nil {
		l.Won, l.TookOver, l.Token = true, *took, token
	}
	return l, nil
}

// BeginLease begins a lease-mode handler's transaction on a connection held
// until Complete or Rollback.
func (d *pgxDriver) BeginLease(ctx context.Context) (driver.LeaseTx, error) {
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	t := &claimTx{d: d, q: &d.q, conn: conn, c: conn.Conn()}
	br, err := t.send(ctx, func(*pgx.Batch) {})
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = t.Rollback(ctx)
		return nil, err
	}
	return t, nil
}

// CompleteLease stores the answer in a statement that commits on its own:
// the connection is taken within ctx, the statement is never cancelled
// (see commitWith); the engine stops waiting for it at its deadline.
func (d *pgxDriver) CompleteLease(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	conn, err := d.pool.Acquire(ctx) // waiting for a connection ends with ctx
	if err != nil {
		return err
	}
	defer conn.Release()
	tag, err := conn.Exec(context.WithoutCancel(ctx), d.q.CompleteLease, a.Source, a.EventID, status, string(headers), body, token)
	if err == nil && tag.RowsAffected() != 1 {
		err = fmt.Errorf("%w (%d rows)", driver.ErrFenced, tag.RowsAffected())
	}
	return err
}

func (d *pgxDriver) EndLease(ctx context.Context, a *driver.Args, token int64, keep bool) error {
	_, err := d.pool.Exec(ctx, d.q.EndLease(keep), a.Source, a.EventID, token)
	return err
}
