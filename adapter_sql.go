package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// sqlDriver is the database/sql adapter: each operation is a sequence of
// statements on a *sql.Tx, one round trip each.
type sqlDriver struct {
	db     *sql.DB
	q      driver.Queries
	opts   *sql.TxOptions
	layout driver.Layout // whether the table is partitioned: adapter_sql_partitioned.go
}

func (d *sqlDriver) PoolCap() int { return d.db.Stats().MaxOpenConnections }

func (d *sqlDriver) Begin(ctx context.Context, a *driver.Args) (driver.Tx, driver.Begun, error) {
	partitioned, err := d.layout.Partitioned(ctx, d.askPartitioned)
	if err != nil {
		return nil, driver.Begun{}, err
	}
	if partitioned {
		return d.beginLockFirst(ctx, a)
	}
	tx, err := d.db.BeginTx(ctx, d.opts)
	if err != nil {
		return nil, driver.Begun{}, err
	}
	t := &sqlTx{tx: tx, q: &d.q}
	var b driver.Begun
	b.Won, err = t.Claim(ctx, a)
	if err == nil && !b.Won {
		b.Row, err = scanRow(tx.QueryRowContext(ctx, d.q.Lookup, a.Source, a.EventID, a.Lock), nil)
	}
	if err != nil {
		_ = tx.Rollback()
		if sqlState(err) == driver.NoConflictTarget {
			// The table has become partitioned (docs/partitioning.md): ask
			// again, and claim lock-first if so.
			d.layout.Forget()
			if p, perr := d.layout.Partitioned(ctx, d.askPartitioned); perr == nil && p {
				return d.beginLockFirst(ctx, a)
			}
		}
		return nil, driver.Begun{}, err
	}
	return t, b, nil
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

func (t *sqlTx) Wait(ctx context.Context, lock int64, d time.Duration) (string, error) {
	var old string
	var locked sql.NullString
	err := t.tx.QueryRowContext(ctx, t.q.Wait, lock, driver.LockTimeout(d)).Scan(&old, &locked)
	return old, err
}

func (t *sqlTx) LookupRestoring(ctx context.Context, a *driver.Args, lockTimeout string) (driver.Row, error) {
	var restored string
	return scanRow(t.tx.QueryRowContext(ctx, t.q.LookupRestoring, a.Source, a.EventID, a.Lock, lockTimeout), &restored)
}

func (t *sqlTx) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	res, err := t.tx.ExecContext(ctx, t.q.Complete, a.Source, a.EventID, status, string(headers), body)
	if err == nil {
		var n int64
		if n, err = res.RowsAffected(); err == nil && n != 1 {
			err = fmt.Errorf("%w (%d rows)", driver.ErrNotStored, n)
		}
	}
	if err == nil {
		err = t.tx.Commit()
	}
	if errors.Is(err, sql.ErrTxDone) {
		err = fmt.Errorf("%w: %w", driver.ErrTxDone, err)
	}
	return err
}

func (t *sqlTx) Rollback(context.Context) error {
	err := t.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		return nil
	}
	return err
}

// scanRow reads a lookup's row; extra receives a trailing column.
func scanRow(r *sql.Row, extra any) (driver.Row, error) {
	var (
		c      driver.Row
		status sql.NullInt32
		done   sql.NullBool
	)
	dest := []any{&c.GotLock, &c.Digest, &status, &c.Headers, &c.Body, &done}
	if extra != nil {
		dest = append(dest, extra)
	}
	if err := r.Scan(dest...); err != nil {
		return c, err
	}
	c.Visible = c.Digest != nil
	c.Completed = done.Valid && done.Bool
	c.Status = int(status.Int32)
	return c, nil
}
