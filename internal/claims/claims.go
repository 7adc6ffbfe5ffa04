// Package claims makes every decision of a claim on idem's table, once for
// both adapters: which statements to send, in which order and transaction,
// and what their results mean, on a plain or a partitioned table, in
// single-transaction or lease mode. It implements driver.Driver, the
// engine's view, over a driver.Pool, which only carries statements.
//
// One property of the Pool chooses between two ways of claiming a key at
// READ COMMITTED. Where a batch travels in one round trip (pgx), the claim
// takes the key's lock first and reads its row in the round trip that
// begins the transaction, and a key won is inserted once, completed, by the
// COMMIT's round trip; the handler's transaction refuses a COMMIT of its
// own there. Where each statement is a round trip (database/sql), the claim
// inserts the key first: one statement for a new key, and a handler that
// commits the *sql.Tx itself leaves a key answered by nothing rather than
// one that runs again.
//
// Nothing here is public API: Go's internal rule keeps it to this module.
package claims

import (
	"context"
	"database/sql"
	"sync"
	"time"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// Store claims keys in one table through one Pool: the driver.Driver of a
// middleware.
type Store struct {
	pool      driver.Pool
	q         driver.Queries
	pipelines bool
	// opts begin a claim on a plain table and a lease-mode handler's
	// transaction: the user's TxOptions, or READ COMMITTED stated when
	// the claim is lock-first.
	opts *sql.TxOptions
	// rc begin a claim on a partitioned table: READ COMMITTED with opts'
	// access mode; nil when the user asks for a higher level, which such a
	// claim refuses (driver.ErrPartitionedIsolation).
	rc        *sql.TxOptions
	lockFirst bool // a claim on a plain table takes the key's lock first
	layout    driver.Layout
	sum       summary.Lazy
	// past are the summaries of a partitioned table's past partitions;
	// tests replace it.
	past func() past
	// LockWait bounds the wait of a claim on a table distributed by Citus
	// for an original in flight (driver.CitusQueries): Options.LockWait.
	// Set before the first claim.
	LockWait time.Duration
	dist     struct {
		once sync.Once
		q    driver.CitusQueries
	}
}

// past is what a claim asks of the summaries (summary.Summaries).
type past interface {
	Answered(ctx context.Context, a *driver.Args, now time.Time) (driver.Row, bool, error)
	Fast(a *driver.Args, now time.Time) *summary.Current
}

// readCommitted begins the lease-mode claim on a partitioned table, which
// only claims: READ COMMITTED whatever the user's options.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// New returns the Store of the table of q on pool, beginning transactions
// with opts (nil: the server's default isolation level); an error for an
// isolation level PostgreSQL does not have.
func New(pool driver.Pool, q driver.Queries, opts *sql.TxOptions) (*Store, error) {
	iso, err := driver.IsoLevel(opts)
	if err != nil {
		return nil, err
	}
	s := &Store{pool: pool, q: q, pipelines: pool.Pipelines(), opts: opts}
	if s.opts == nil {
		s.opts = &sql.TxOptions{}
	}
	if iso == "" || iso == "read committed" || iso == "read uncommitted" {
		s.rc = &sql.TxOptions{Isolation: sql.LevelReadCommitted, ReadOnly: s.opts.ReadOnly}
		if s.lockFirst = s.pipelines; s.lockFirst {
			// The lock-first claim needs READ COMMITTED (a statement's
			// snapshot taken after the lock): say so, whatever the
			// server's default_transaction_isolation.
			s.opts = s.rc
		}
	}
	s.past = func() past { return s.Summaries() }
	return s, nil
}

// PoolCap is the pool's connection cap, 0 for none.
func (s *Store) PoolCap() int { return s.pool.Cap() }

// Summaries are those of the table's past partitions, if it is partitioned
// (summary.Summarised).
func (s *Store) Summaries() *summary.Summaries { return s.sum.Get(s.q.Table, s.pool.Query) }

// kind is the table's layout, asked of the database on the first claim
// (driver.Layout): whether it is partitioned, and distributed by Citus.
func (s *Store) kind(ctx context.Context) (driver.Kind, error) {
	return s.layout.Kind(ctx, func(ctx context.Context) (driver.Kind, error) {
		var partitioned, citus *bool
		err := s.pool.Query(ctx, driver.LayoutSQL, []any{s.q.Table}, func(scan func(...any) error) error { return scan(&partitioned, &citus) })
		if err != nil || partitioned == nil {
			return 0, err
		}
		k := driver.Plain
		if *partitioned {
			k = driver.Partitioned
		}
		if *citus {
			var dist bool
			err = s.pool.Query(ctx, driver.DistributedSQL, []any{s.q.Table}, func(scan func(...any) error) error { return scan(&dist) })
			if dist {
				k += driver.Distributed - driver.Plain
			}
		}
		return k, err
	})
}

// distributed are the statements of a claim on a table distributed by
// Citus, built on first use.
func (s *Store) distributed() *driver.CitusQueries {
	s.dist.once.Do(func() { s.dist.q = driver.NewCitusQueries(s.q.Table, s.LockWait, !s.pipelines) })
	return &s.dist.q
}

// newTx takes a connection for a claim's transaction, which begins with
// opts when its first batch is sent.
func (s *Store) newTx(ctx context.Context, q *driver.Queries, opts *sql.TxOptions) (*tx, error) {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &tx{s: s, c: c, q: q, opts: opts, lockFirst: s.pipelines && opts.Isolation <= sql.LevelReadCommitted}, nil
}

// Begin begins a transaction and claims the key in it. On a plain table:
// lock-first, or by inserting the key first (see the package comment), and
// then, when the key is not won, its row and lock read by a statement of
// their own; on a table distributed by Citus, by inserting the key first,
// without a lock (beginDistributed). A claim on a table found to have
// become partitioned (the plain claim's ON CONFLICT has no unique index to
// use) is made again as on one.
func (s *Store) Begin(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	kind, err := s.kind(ctx)
	switch {
	case err != nil:
		return driver.Begun{}, err
	case kind == driver.Partitioned:
		return s.beginPartitioned(ctx, a)
	case kind == driver.Distributed:
		return s.beginDistributed(ctx, a)
	case kind == driver.DistributedPartitioned:
		return driver.Begun{}, driver.ErrDistributedPartitioned
	}
	t, err := s.newTx(ctx, &s.q, s.opts)
	if err != nil {
		return driver.Begun{}, err
	}
	b, err := t.claimPlain(ctx, a)
	if err == nil {
		b.Tx = t
		return b, nil
	}
	_ = t.Rollback(ctx)
	if driver.SQLState(err) == driver.NoConflictTarget {
		s.layout.Forget()
		if k, kerr := s.kind(ctx); kerr == nil && k == driver.Partitioned {
			return s.beginPartitioned(ctx, a)
		}
	}
	return driver.Begun{}, err
}

// beginPartitioned claims on a partitioned table (docs/partitioning.md),
// whose partitions each have their own primary key, so that ON CONFLICT
// sees one partition only. A key whose answer the summaries of the past
// partitions find in one of them is answered by one statement, outside any
// transaction. Otherwise, when the summaries rule the key out of every past
// partition but some, the key is claimed on the current partition as on a
// plain table, after looking for it in those (claimCurrent); a claim there
// that fails for a reason of the partitions' (summary.ClaimAgainEverywhere:
// begun past the partition's end, a partition dropped since the last
// listing) is made again, in a new transaction, across every partition,
// as is a claim without summaries (claimEverywhere).
func (s *Store) beginPartitioned(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	if s.rc == nil {
		return driver.Begun{}, driver.ErrPartitionedIsolation
	}
	sum := s.past()
	if row, ok, err := sum.Answered(ctx, a, time.Now()); ok || err != nil {
		return driver.Begun{Answered: ok, Row: row}, err
	}
	t, err := s.newTx(ctx, &s.q, s.rc)
	if err != nil {
		return driver.Begun{}, err
	}
	// Asked once the connection is held: a wait for one could otherwise
	// take the claim past the current partition's end.
	if c := sum.Fast(a, time.Now()); c != nil {
		t.q, t.current = &c.Queries, c
		b, err := t.claimCurrent(ctx, a)
		if err == nil {
			b.Tx = t
			return b, nil
		}
		if summary.ClaimAgainEverywhere(err) {
			err = t.c.Send(ctx, &driver.Batch{Rollback: true})
			t.q, t.current, t.open, t.insertAtEnd = &s.q, nil, false, false
		}
		if err != nil {
			_ = t.Rollback(ctx)
			return driver.Begun{}, err
		}
	}
	b, err := t.claimEverywhere(ctx, a)
	if err != nil {
		_ = t.Rollback(ctx)
		return driver.Begun{}, err
	}
	b.Tx = t
	return b, nil
}
