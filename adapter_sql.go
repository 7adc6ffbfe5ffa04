package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// sqlDriver is the database/sql adapter: each operation is a sequence of
// statements on a *sql.Tx, one round trip each.
type sqlDriver struct {
	db     *sql.DB
	q      driver.Queries
	opts   *sql.TxOptions
	layout driver.Layout // whether the table is partitioned: adapter_sql_partitioned.go
	sum    summary.Lazy  // of a partitioned table's past partitions
}

func (d *sqlDriver) PoolCap() int { return d.db.Stats().MaxOpenConnections }

// begin begins a transaction whose COMMIT is never cancelled: database/sql
// sends COMMIT on the context the transaction began with, through pgx,
// which cancels a query whose context ends, and a COMMIT waiting for a
// synchronous standby would then commit locally, unreplicated, and answer
// success. So the transaction begins on a context that does not end (which
// also spares database/sql a goroutine watching it); every statement is
// sent with ctx, and the engine rolls back what it does not commit.
func (d *sqlDriver) begin(ctx context.Context, q *driver.Queries, opts *sql.TxOptions) (*sqlTx, error) {
	tx, err := d.db.BeginTx(context.WithoutCancel(ctx), opts)
	if err != nil {
		return nil, err
	}
	return &sqlTx{tx: tx, q: q}, nil
}

func (d *sqlDriver) Begin(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	partitioned, err := d.layout.Partitioned(ctx, d.askPartitioned)
	if err != nil {
		return driver.Begun{}, err
	}
	if partitioned {
		return d.beginPartitioned(ctx, a)
	}
	t, err := d.begin(ctx, &d.q, d.opts)
	if err != nil {
		return driver.Begun{}, err
	}
	b, err := t.claimPlain(ctx, a)
	if err != nil {
		_ = t.Rollback(ctx)
	}
	if driver.SQLState(err) == driver.NoConflictTarget {
		// The table has become partitioned (docs/partitioning.md): ask
		// again, and claim as on one if so.
		d.layout.Forget()
		if p, perr := d.layout.Partitioned(ctx, d.askPartitioned); perr == nil && p {
			return d.beginPartitioned(ctx, a)
		}
	}
	if err != nil {
		return driver.Begun{}, err
	}
	b.Tx = t
	return b, nil
}

// claimPlain claims the key with t's plain statements, in its open
// transaction: on a plain table, or on the current partition of a
// partitioned one.
func (t *sqlTx) claimPlain(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	var b driver.Begun
	var err error
	b.Won, err = t.Claim(ctx, a)
	if err == nil && !b.Won {
		b.Row, err = driver.Lookup(t.tx.QueryRowContext(ctx, t.q.Lookup, a.Source, a.EventID, a.Lock).Scan)
	}
	return b, err
}

type sqlTx struct {
	tx        *sql.Tx
	q         *driver.Queries
	lockFirst bool // a partitioned table's claim: adapter_sql_partitioned.go
}

func (t *sqlTx) Handle() any { return t.tx }

func (t *sqlTx) Claim(ctx context.Context, a *driver.Args) (bool, error) {
	if t.lockFirst {
		b, err := t.claimOrRead(ctx, a, true)
		return b.Won, err
	}
	var won bool
	err := t.tx.QueryRowContext(ctx, t.q.Claim, a.Source, a.EventID, a.Digest, a.Lock).Scan(&won)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return won, err
}

func (t *sqlTx) Wait(ctx context.Context, a *driver.Args, d time.Duration) (driver.Row, error) {
	var old, restored string
	var locked sql.NullString
	if err := t.tx.QueryRowContext(ctx, t.q.Wait, a.Lock, driver.LockTimeout(d)).Scan(&old, &locked); err != nil {
		return driver.Row{}, err
	}
	return driver.Lookup(t.tx.QueryRowContext(ctx, t.q.LookupRestoring, a.Source, a.EventID, a.Lock, old).Scan, &restored)
}

func (t *sqlTx) TakeOver(ctx context.Context, a *driver.Args) (bool, error) {
	res, err := t.tx.ExecContext(ctx, t.q.TakeOver, a.Source, a.EventID, a.Digest, a.Lock)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

func (t *sqlTx) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	complete := t.q.Complete
	if t.lockFirst {
		complete = t.q.CompleteClaimedNow // one partition, not each
	}
	return t.commitWith(ctx, driver.ErrNotStored, complete, a.Source, a.EventID, status, string(headers), body)
}

// Complete is the lease-mode commit: the answer is stored only if token
// still owns the key.
func (t *sqlTx) Complete(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	return t.commitWith(ctx, driver.ErrFenced, t.q.CompleteLease, a.Source, a.EventID, status, string(headers), body, token)
}

// commitWith runs the statement that stores the answer, which must change
// one row (else the error is none), and commits.
func (t *sqlTx) commitWith(ctx context.Context, none error, query string, args ...any) error {
	res, err := t.tx.ExecContext(ctx, query, args...)
	if err == nil {
		err = oneRow(res, none)
	}
	if err == nil {
		err = ctx.Err() // the deadline passed: the engine rolls back
	}
	if err == nil {
		err = t.tx.Commit() // on a context that does not end
	}
	if errors.Is(err, sql.ErrTxDone) {
		err = fmt.Errorf("%w: %w: %w", driver.ErrTxDone, driver.ErrTxEnded, err)
	}
	return err
}

// oneRow is nil when res changed exactly one row, else none (or the error
// reading the count).
func oneRow(res sql.Result, none error) error {
	n, err := res.RowsAffected()
	if err == nil && n != 1 {
		err = fmt.Errorf("%w (%d rows)", none, n)
	}
	return err
}

func (d *sqlDriver) ClaimLease(ctx context.Context, a *driver.Args, lease, wait time.Duration, token int64) (driver.Lease, error) {
	if partitioned, err := d.layout.Partitioned(ctx, d.askPartitioned); err != nil || partitioned {
		if err != nil {
			return driver.Lease{}, err
		}
		return d.claimLeaseLockFirst(ctx, a, lease, token)
	}
	var l driver.Lease
	err := d.db.QueryRowContext(ctx, d.q.ClaimLease, a.Source, a.EventID, a.Digest, a.Lock, lease.Microseconds(), token, driver.LockTimeout(wait)).Scan(&l.TookOver)
	switch {
	case err == nil:
		l.Won, l.Token = true, token
		return l, nil
	case !errors.Is(err, sql.ErrNoRows):
		return l, err
	}
	l.Row, err = driver.Lookup(d.db.QueryRowContext(ctx, d.q.Lookup, a.Source, a.EventID, a.Lock).Scan)
	return l, err
}

func (d *sqlDriver) BeginLease(ctx context.Context) (driver.LeaseTx, error) {
	t, err := d.begin(ctx, &d.q, d.opts)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// CompleteLease stores the answer in a statement that commits on its own:
// the connection is taken within ctx, and the statement sent on a context
// that does not end (see begin); the engine stops waiting for it at its
// deadline.
func (d *sqlDriver) CompleteLease(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	conn, err := d.db.Conn(ctx) // waiting for a connection ends with ctx
	if err != nil {
		return err
	}
	defer conn.Close()
	res, err := conn.ExecContext(context.WithoutCancel(ctx), d.q.CompleteLease, a.Source, a.EventID, status, string(headers), body, token)
	if err != nil {
		return err
	}
	return oneRow(res, driver.ErrFenced)
}

func (d *sqlDriver) EndLease(ctx context.Context, a *driver.Args, token int64, keep bool) error {
	_, err := d.db.ExecContext(ctx, d.q.EndLease(keep), a.Source, a.EventID, token)
	return err
}

func (t *sqlTx) Rollback(context.Context) error {
	err := t.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}
