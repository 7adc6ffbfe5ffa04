package claims

import (
	"context"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// ClaimLease claims the key in lease mode, in a statement that commits on
// its own, and reads the key's row and lock with a second one when it
// claimed nothing; on a partitioned table, lock-first in a transaction of
// its own (claimLeaseEverywhere); on a table distributed by Citus, without
// a lock (claimLeaseDistributed).
func (s *Store) ClaimLease(ctx context.Context, a *driver.Args, lease, wait time.Duration, token int64) (driver.Lease, error) {
	kind, err := s.kind(ctx)
	switch {
	case err != nil:
		return driver.Lease{}, err
	case kind == driver.Partitioned:
		return s.claimLeaseEverywhere(ctx, a, lease, token)
	case kind == driver.Distributed:
		return s.claimLeaseDistributed(ctx, a, lease, token)
	case kind == driver.DistributedPartitioned:
		return driver.Lease{}, driver.ErrDistributedPartitioned
	}
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return driver.Lease{}, err
	}
	defer func() { _ = c.Close(ctx) }()
	var l driver.Lease
	b := driver.Batch{Stmts: []driver.Stmt{{
		SQL:  s.q.ClaimLease,
		Args: []any{a.Source, a.EventID, a.Digest, a.Lock, lease.Microseconds(), token, driver.LockTimeout(wait)},
		Dest: []any{&l.TookOver},
	}}}
	if err := c.Send(ctx, &b); err != nil || !b.Stmts[0].NoRow {
		if err == nil {
			l.Won, l.Token = true, token
		}
		return l, err
	}
	var sc driver.Scan
	b = driver.Batch{Stmts: []driver.Stmt{{SQL: s.q.Lookup, Args: []any{a.Source, a.EventID, a.Lock}, Dest: sc.Lookup()}}}
	err = c.Send(ctx, &b)
	l.Row = sc.Row()
	return l, err
}

// claimLeaseEverywhere is the lease-mode claim on a partitioned table: in
// a transaction of its own, the key's lock without waiting, then, with a
// new statement, the claim or the key's row (driver.Queries.ClaimLeaseOrRead)
// and COMMIT; or, first, the key's answer read from a past partition.
func (s *Store) claimLeaseEverywhere(ctx context.Context, a *driver.Args, lease time.Duration, token int64) (driver.Lease, error) {
	if row, ok, err := s.past().Answered(ctx, a, time.Now()); ok || err != nil {
		return driver.Lease{Row: row}, err // answered without a transaction
	}
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return driver.Lease{}, err
	}
	defer func() { _ = c.Close(ctx) }()
	var sc driver.Scan
	b := driver.Batch{Begin: readCommitted, Stmts: []driver.Stmt{{SQL: s.q.TryLock, Args: []any{a.Lock}, Dest: []any{&sc.Locked}}}}
	if err := c.Send(ctx, &b); err != nil {
		return driver.Lease{}, err
	}
	var took *bool // NULL: nothing claimed
	b = driver.Batch{Commit: true, Stmts: []driver.Stmt{{
		SQL:  s.q.ClaimLeaseOrRead,
		Args: []any{a.Source, a.EventID, a.Digest, sc.Locked, lease.Microseconds(), token},
		Dest: sc.Columns(&took),
	}}}
	if err := c.Send(ctx, &b); err != nil {
		return driver.Lease{}, err
	}
	l := driver.Lease{Row: sc.Row()}
	if took != nil {
		l.Won, l.TookOver, l.Token = true, *took, token
	}
	return l, nil
}

// BeginLease begins a lease-mode handler's transaction.
func (s *Store) BeginLease(ctx context.Context) (driver.LeaseTx, error) {
	t, err := s.newTx(ctx, &s.q, s.opts)
	if err == nil {
		if err = t.send(ctx, &driver.Batch{}); err != nil {
			_ = t.Rollback(ctx)
		}
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

// CompleteLease stores the answer of a lease-mode handler that wrote
// nothing, in a statement that commits on its own, only if token still
// owns the key. The connection is taken within ctx; the statement, which
// commits, is never cancelled (driver.Batch.Commit).
func (s *Store) CompleteLease(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close(ctx) }()
	b := driver.Batch{Commit: true, Stmts: []driver.Stmt{{SQL: s.q.CompleteLease, Args: []any{a.Source, a.EventID, status, string(headers), body, token}}}}
	if err = c.Send(ctx, &b); err == nil && b.Stmts[0].N != 1 {
		err = fmt.Errorf("%w (%d rows)", driver.ErrFenced, b.Stmts[0].N)
	}
	return err
}

// ExtendLease makes the lease that token owns run for lease from now
// (driver.Driver).
func (s *Store) ExtendLease(ctx context.Context, a *driver.Args, token int64, lease time.Duration) error {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close(ctx) }()
	b := driver.Batch{Stmts: []driver.Stmt{{SQL: s.q.ExtendLease, Args: []any{a.Source, a.EventID, token, lease.Microseconds()}}}}
	if err = c.Send(ctx, &b); err == nil && b.Stmts[0].N != 1 {
		err = fmt.Errorf("%w (%d rows)", driver.ErrFenced, b.Stmts[0].N)
	}
	return err
}

// EndLease ends the lease that token owns on a key not completed: it
// deletes the row, or, with keep, turns it into a claim committed without
// an answer (driver.Driver).
func (s *Store) EndLease(ctx context.Context, a *driver.Args, token int64, keep bool) error {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close(ctx) }()
	return c.Send(ctx, &driver.Batch{Stmts: []driver.Stmt{{SQL: s.q.EndLease(keep), Args: []any{a.Source, a.EventID, token}}}})
}
