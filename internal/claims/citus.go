package claims

import (
	"context"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// The claim on a table distributed by Citus (driver.CitusQueries): the key's
// row is inserted at the start of the transaction, and the shard's unique
// index, not an advisory lock, decides which delivery owns the key, on
// whichever node each instance is connected to. A duplicate of a key in
// flight waits at its INSERT for the original to end, at most LockWait
// (SQLSTATE 55P03 then), and reads the original's row with a statement
// after it; the engine's own wait (driver.Tx.Wait) is never needed, since
// no lookup reports a key in flight.

// beginDistributed begins a transaction, sets lock_timeout for it so that
// Citus propagates it, and inserts the key's claim; when it inserts
// nothing, a statement of its own reads the key's row.
func (s *Store) beginDistributed(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	t, err := s.newTx(ctx, &s.q, s.opts)
	if err != nil {
		return driver.Begun{}, err
	}
	t.lockFirst, t.dist = false, s.distributed()
	b, err := t.claimPlain(ctx, a) // inserting first: t.insert, t.lookup
	if err != nil {
		_ = t.Rollback(ctx)
		return driver.Begun{}, err
	}
	b.Tx = t
	return b, nil
}

// insertDistributed sends the claim's INSERT, preceded, in the batch that
// begins the transaction, by the statements that set its lock_timeout.
func (t *tx) insertDistributed(ctx context.Context, a *driver.Args) (bool, error) {
	var won bool
	claim := driver.Stmt{SQL: t.dist.Claim, Args: []any{a.Source, a.EventID, a.Digest}, Dest: []any{&won}}
	b := t.batch(claim)
	if !t.open {
		b.Stmts = b.Stmts[:0]
		for _, set := range t.dist.Set {
			b.Stmts = append(b.Stmts, driver.Stmt{SQL: set})
		}
		b.Stmts = append(b.Stmts, claim)
	}
	err := t.send(ctx, b)
	return won, err
}

// claimLeaseDistributed is the lease-mode claim on a table distributed by
// Citus: in a transaction of its own, lock_timeout set as for a claim, the
// key inserted in progress or taken over, and COMMIT; when it claims
// nothing, a second statement reads the key's row.
func (s *Store) claimLeaseDistributed(ctx context.Context, a *driver.Args, lease time.Duration, token int64) (driver.Lease, error) {
	d := s.distributed()
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return driver.Lease{}, err
	}
	defer func() { _ = c.Close(ctx) }()
	var l driver.Lease
	b := driver.Batch{Begin: readCommitted, Commit: true}
	for _, set := range d.Set {
		b.Stmts = append(b.Stmts, driver.Stmt{SQL: set})
	}
	b.Stmts = append(b.Stmts, driver.Stmt{
		SQL:  d.ClaimLease,
		Args: []any{a.Source, a.EventID, a.Digest, lease.Microseconds(), token},
		Dest: []any{&l.TookOver},
	})
	if err := c.Send(ctx, &b); err != nil || !b.Stmts[len(b.Stmts)-1].NoRow {
		if err == nil {
			l.Won, l.Token = true, token
		}
		return l, err
	}
	sc := driver.Scan{Locked: true} // no lock: what the row holds decides
	b = driver.Batch{Stmts: []driver.Stmt{{SQL: d.Read, Args: []any{a.Source, a.EventID}, Dest: sc.Columns()}}}
	err = c.Send(ctx, &b)
	l.Row = sc.Row()
	return l, err
}

// distributedLookup is the lookup of a claim on a table distributed by
// Citus: the key's row, without its lock, which no claim there takes. A
// key without a row reads as Free, and is claimed again by an INSERT that
// the unique index arbitrates; a lease that ran out reads as
// LeaseExpired, and is taken over by an UPDATE whose row lock arbitrates.
func (t *tx) distributedLookup(a *driver.Args, s *driver.Scan) driver.Stmt {
	s.Locked = true
	return driver.Stmt{SQL: t.dist.Read, Args: []any{a.Source, a.EventID}, Dest: s.Columns()}
}
