package idem

import (
	"context"
	"database/sql"
	"errors"

	"github.com/pgidem/idem/internal/driver"
)

// The database/sql adapter on a partitioned table (docs/partitioning.md):
// the claim takes the key's lock first, with a statement of its own, then
// reads the key's row in every partition with a new statement, whose
// snapshot comes after the lock; the completed row is inserted at the end,
// with the answer. ON CONFLICT would see one partition only.

// askPartitioned asks whether the table is partitioned; nil when it does
// not exist.
func (d *sqlDriver) askPartitioned(ctx context.Context) (*bool, error) {
	var p sql.NullBool
	err := d.db.QueryRowContext(ctx, driver.PartitionedSQL, d.q.Table).Scan(&p)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && !p.Valid) {
		return nil, nil
	}
	return &p.Bool, err
}

// lockFirstOptions are d's transaction options for lock-first claims: READ
// COMMITTED stated in BEGIN (whatever the server's default), or
// driver.ErrPartitionedIsolation for a higher level.
func (d *sqlDriver) lockFirstOptions() (*sql.TxOptions, error) {
	o := sql.TxOptions{Isolation: sql.LevelReadCommitted}
	if d.opts != nil {
		switch d.opts.Isolation {
		case sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted:
		default:
			return nil, driver.ErrPartitionedIsolation
		}
		o.ReadOnly = d.opts.ReadOnly
	}
	return &o, nil
}

// beginLockFirst begins a transaction, takes the key's lock without
// waiting and reads its row with a new statement. The key is won when the
// lock is taken and no partition holds a row.
func (d *sqlDriver) beginLockFirst(ctx context.Context, a *driver.Args) (driver.Tx, driver.Begun, error) {
	opts, err := d.lockFirstOptions()
	if err != nil {
		return nil, driver.Begun{}, err
	}
	tx, err := d.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, driver.Begun{}, err
	}
	var b driver.Begun
	err = tx.QueryRowContext(ctx, d.q.TryLock, a.Lock).Scan(&b.Row.GotLock)
	if err == nil {
		b.Row, err = scanRead(tx.QueryRowContext(ctx, d.q.Read, a.Source, a.EventID), b.Row)
	}
	if err != nil {
		_ = tx.Rollback()
		return nil, driver.Begun{}, err
	}
	b.Won = b.Row.GotLock && !b.Row.Visible
	return &sqlTx{tx: tx, q: &d.q, lockFirst: true, insertAtEnd: b.Won}, b, nil
}

// scanRead reads the Read statement's row into row; no row is Visible false.
func scanRead(r *sql.Row, row driver.Row) (driver.Row, error) {
	var (
		status sql.NullInt32
		done   sql.NullBool
	)
	err := r.Scan(&row.Digest, &status, &row.Headers, &row.Body, &done)
	if errors.Is(err, sql.ErrNoRows) {
		return row, nil
	}
	if err != nil {
		return row, err
	}
	row.Visible = true
	row.Completed = done.Valid && done.Bool
	row.Status = int(status.Int32)
	return row, nil
}

// commitInserting inserts the key's completed row and commits. The key's
// lock has been held since the claim found no row, so no other claim can
// have inserted one; the partition's primary key refuses a second row
// anyway.
func (t *sqlTx) commitInserting(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	_, err := t.tx.ExecContext(ctx, t.q.InsertCompleted, a.Source, a.EventID, a.Digest, status, string(headers), body)
	return t.commit(err)
}
