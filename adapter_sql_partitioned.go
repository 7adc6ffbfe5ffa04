package idem

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// The database/sql adapter on a partitioned table (docs/partitioning.md):
// ON CONFLICT would see one partition only, so the claim takes the key's
// lock first, with a statement of its own, and then, with a new statement
// whose snapshot comes after the lock, looks for the key in every partition
// and inserts the claim if there is none (driver.Queries.ClaimOrRead). The
// answer is stored by the same UPDATE as on a plain table.

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

// beginPartitioned answers from a past partition when the summaries find
// the key's answer there (no transaction); otherwise it claims on the
// current partition as on a plain table when the summaries of the past
// partitions rule the key out, there too after looking for the key in the
// past partitions that may hold it when some do not, and lock-first across
// the partitions when there are no summaries. Where to claim is asked once
// the transaction has begun (a wait for a connection could otherwise take
// the claim past the current partition's end); a claim there that fails
// for a reason of the partitions' (summary.ClaimAgainEverywhere) is made
// again across every partition.
func (d *sqlDriver) beginPartitioned(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	opts, err := d.lockFirstOptions()
	if err != nil {
		return driver.Begun{}, err
	}
	if row, ok, err := d.Summaries().Answered(ctx, a, time.Now()); ok || err != nil {
		return driver.Begun{Answered: ok, Row: row}, err
	}
	t, err := d.begin(ctx, &d.q, opts)
	if err != nil {
		return driver.Begun{}, err
	}
	if c := d.Summaries().Fast(a, time.Now()); c != nil {
		t.q = &c.Queries
		b, err := t.claimCurrent(ctx, a, c)
		if err == nil {
			b.Tx = t
			return b, nil
		}
		_ = t.Rollback(ctx)
		if !summary.ClaimAgainEverywhere(err) {
			return driver.Begun{}, err
		}
		if t, err = d.begin(ctx, &d.q, opts); err != nil {
			return driver.Begun{}, err
		}
	}
	b, err := t.claimLockFirst(ctx, a)
	if err != nil {
		_ = t.Rollback(ctx)
		return driver.Begun{}, err
	}
	b.Tx = t
	return b, nil
}

// claimCurrent claims the key on c, the current partition, in t's open
// transaction: as on a plain table, or, when some past partitions may hold
// the key, with ClaimPast, which also reads its row there. A completed row
// found there is the answer; otherwise, when nothing was inserted, the
// lookup reads the key's row in c and those partitions, and its lock.
func (t *sqlTx) claimCurrent(ctx context.Context, a *driver.Args, c *summary.Current) (driver.Begun, error) {
	if c.ClaimPast == "" {
		return t.claimPlain(ctx, a)
	}
	var (
		b     driver.Begun
		began time.Time
		s     driver.Scan // the lock does not matter: the lookup reads it
		err   error
	)
	b.Row, err = s.Read(t.tx.QueryRowContext(ctx, c.ClaimPast, a.Source, a.EventID, a.Digest, a.Lock).Scan, &b.Won, &began)
	if err != nil || b.Won || b.Row.State == driver.Completed {
		return b, err
	}
	if !c.Holds(began) {
		return b, summary.ErrOutside
	}
	b.Row, err = driver.Lookup(t.tx.QueryRowContext(ctx, c.Lookup, a.Source, a.EventID, a.Lock).Scan)
	return b, err
}

// Summaries are those of d's table, if partitioned.
func (d *sqlDriver) Summaries() *summary.Summaries { return d.sum.Get(d.q.Table, d.query) }

// query is the summary.Querier of the summaries.
func (d *sqlDriver) query(ctx context.Context, query string, args []any, each func(func(...any) error) error) error {
	rows, err := d.db.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return summary.EachRow(rows, each)
}

// claimLockFirst takes the key's lock without waiting and claims the key
// or reads its row with a new statement, in t's open transaction.
func (t *sqlTx) claimLockFirst(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	t.lockFirst = true
	var locked bool
	if err := t.tx.QueryRowContext(ctx, t.q.TryLock, a.Lock).Scan(&locked); err != nil {
		return driver.Begun{}, err
	}
	return t.claimOrRead(ctx, a, locked)
}

// claimOrRead sends ClaimOrRead: the claim when locked and no partition
// holds the key, else the key's row, if any.
func (t *sqlTx) claimOrRead(ctx context.Context, a *driver.Args, locked bool) (driver.Begun, error) {
	var b driver.Begun
	s := driver.Scan{Locked: locked}
	var err error
	b.Row, err = s.Read(t.tx.QueryRowContext(ctx, t.q.ClaimOrRead, a.Source, a.EventID, a.Digest, locked).Scan, &b.Won)
	return b, err
}

// claimLeaseLockFirst is the lease-mode claim on a partitioned table: in a
// transaction of its own, the key's lock without waiting, then, with a new
// statement, the claim or the key's row (driver.Queries.ClaimLeaseOrRead),
// then COMMIT; or, first, the key's answer read from a past partition
// (summary.Summaries.Answered).
func (d *sqlDriver) claimLeaseLockFirst(ctx context.Context, a *driver.Args, lease time.Duration, token int64) (driver.Lease, error) {
	if row, ok, err := d.Summaries().Answered(ctx, a, time.Now()); ok || err != nil {
		return driver.Lease{Row: row}, err // answered from a past partition, without a transaction
	}
	// READ COMMITTED whatever TxOptions say: this transaction only claims,
	// and its second statement must see what committed before the lock.
	tx, err := d.db.BeginTx(context.WithoutCancel(ctx), &sql.TxOptions{Isolation: sql.LevelReadCommitted}) // see begin
	if err != nil {
		return driver.Lease{}, err
	}
	defer func() { _ = tx.Rollback() }()
	var s driver.Scan
	if err := tx.QueryRowContext(ctx, d.q.TryLock, a.Lock).Scan(&s.Locked); err != nil {
		return driver.Lease{}, err
	}
	var (
		l    driver.Lease
		took sql.NullBool
	)
	l.Row, err = s.Read(tx.QueryRowContext(ctx, d.q.ClaimLeaseOrRead, a.Source, a.EventID, a.Digest, s.Locked, lease.Microseconds(), token).Scan, &took)
	if err == nil {
		err = ctx.Err()
	}
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return driver.Lease{}, err
	}
	if took.Valid {
		l.Won, l.TookOver, l.Token = true, took.Bool, token
	}
	return l, nil
}
