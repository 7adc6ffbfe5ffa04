package claims

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
)

// tx is a claim's transaction (driver.Tx), and a lease-mode handler's
// (driver.LeaseTx), on a connection held from Begin to Commit or Rollback.
type tx struct {
	s       *Store
	c       driver.Conn
	q       *driver.Queries  // the Store's, or the current partition's
	current *summary.Current // a partitioned table's current partition, claimed on as a plain table
	opts    *sql.TxOptions   // BEGIN's
	open    bool             // a transaction is open on c
	// lockFirst: the key is claimed by taking its lock and finding no
	// row; insertAtEnd: so it was, and Commit inserts its row.
	lockFirst, insertAtEnd bool
	// orRead: a claim across a partitioned table's partitions that
	// inserts the key first (ClaimOrRead); the answer is then stored by
	// CompleteClaimedNow, in one partition.
	orRead bool
	// dist: the table is distributed by Citus, and these are its
	// statements (citus.go).
	dist *driver.CitusQueries
	// b and st are the batch being sent, reused: a request allocates none.
	b  driver.Batch
	st [3]driver.Stmt
}

// batch returns t's batch, holding stmts and nothing else.
func (t *tx) batch(stmts ...driver.Stmt) *driver.Batch {
	t.b = driver.Batch{Stmts: append(t.st[:0], stmts...)}
	return &t.b
}

// send sends b, beginning a transaction first when none is open.
func (t *tx) send(ctx context.Context, b *driver.Batch) error {
	if !t.open {
		b.Begin, t.open = t.opts, true
	}
	return t.c.Send(ctx, b)
}

func (t *tx) Handle() any { return t.c.Handle() }

// claimPlain claims the key with t.q's plain statements (a plain table, or
// the current partition of a partitioned one): lock-first, or by inserting
// the key and then, when nothing was inserted, reading its row and lock.
func (t *tx) claimPlain(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	if t.lockFirst {
		return t.lockAndRead(ctx, a)
	}
	won, err := t.insert(ctx, a)
	if err != nil || won {
		return driver.Begun{Won: won}, err
	}
	row, err := t.lookup(ctx, a)
	return driver.Begun{Row: row}, err
}

// insert sends the claim's INSERT (Queries.Claim; on a table distributed
// by Citus, insertDistributed).
func (t *tx) insert(ctx context.Context, a *driver.Args) (bool, error) {
	if t.dist != nil {
		return t.insertDistributed(ctx, a)
	}
	var won bool
	b := t.batch(driver.Stmt{SQL: t.q.Claim, Args: []any{a.Source, a.EventID, a.Digest, a.Lock}, Dest: []any{&won}})
	err := t.send(ctx, b)
	return won, err
}

// lookup reads the key's row and lock with a new statement, whose snapshot
// sees what committed before it. Above READ COMMITTED the snapshot is the
// transaction's first, so the lookup also ends the transaction (in the same
// round trip where the Pool pipelines), which a replay no longer needs. A
// wait then begins a new one, whose snapshot its own statement takes before
// the original ends: a row committed meanwhile is invisible to it, and the
// claim after the wait fails with a serialization failure, which the
// engine meets by claiming again in a new transaction.
func (t *tx) lookup(ctx context.Context, a *driver.Args) (driver.Row, error) {
	var s driver.Scan
	stmt := driver.Stmt{SQL: t.q.Lookup, Args: []any{a.Source, a.EventID, a.Lock}, Dest: s.Lookup()}
	if t.dist != nil {
		stmt = t.distributedLookup(a, &s)
	}
	b := t.batch(stmt)
	b.Rollback = t.opts.Isolation > sql.LevelReadCommitted
	err := t.c.Send(ctx, b)
	if err == nil && b.Rollback {
		t.open = false
	}
	return s.Row(), err
}

// lockAndRead takes the key's lock without waiting, then reads its row with
// a statement of its own (its snapshot after the lock), in one batch that
// begins the transaction when none is open; on the current partition it
// also reads when the transaction began (summary.Current.Holds). The key is
// won when the lock is taken and there is no row: Commit inserts it.
func (t *tx) lockAndRead(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	var (
		s     driver.Scan
		began time.Time
	)
	lock := driver.Stmt{SQL: t.q.TryLock, Args: []any{a.Lock}, Dest: []any{&s.Locked}}
	if t.current != nil {
		lock.SQL, lock.Dest = summary.TryLockAt, []any{&s.Locked, &began}
	}
	b := t.batch(lock, driver.Stmt{SQL: t.q.Read, Args: []any{a.Source, a.EventID}, Dest: s.Columns()})
	err := t.send(ctx, b)
	if err == nil && t.current != nil && !t.current.Holds(began) {
		err = summary.ErrOutside
	}
	begun := driver.Begun{Row: s.Row()}
	begun.Won = err == nil && begun.Row.State == driver.Free
	t.insertAtEnd = begun.Won
	return begun, err
}

// claimCurrent claims the key on the current partition: as on a plain
// table, or, when some past partitions may hold the key, with ClaimPast,
// which looks for it there first. A completed row found there is the
// answer; otherwise, when nothing was inserted, the lookup reads the key's
// row in the current partition and those, and its lock. A key ClaimPast
// won is inserted now, and its answer stored by an UPDATE.
func (t *tx) claimCurrent(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	if t.current.ClaimPast == "" {
		return t.claimPlain(ctx, a)
	}
	var (
		begun driver.Begun
		began time.Time
		s     driver.Scan // the lock does not matter: the lookup reads it
	)
	b := t.batch(driver.Stmt{SQL: t.current.ClaimPast, Args: []any{a.Source, a.EventID, a.Digest, a.Lock}, Dest: s.Columns(&begun.Won, &began)})
	err := t.send(ctx, b)
	begun.Row = s.Row()
	if err != nil || begun.Won || begun.Row.State == driver.Completed {
		return begun, err
	}
	if !t.current.Holds(began) {
		return begun, summary.ErrOutside
	}
	begun.Row, err = t.lookup(ctx, a)
	return begun, err
}

// claimEverywhere claims the key across every partition: its lock without
// waiting, then, with a statement of its own (its snapshot after the lock),
// its row in every partition; lock-first, or, inserting the key first,
// with ClaimOrRead, which inserts it when there is no row and the lock is
// this transaction's.
func (t *tx) claimEverywhere(ctx context.Context, a *driver.Args) (driver.Begun, error) {
	if t.lockFirst {
		return t.lockAndRead(ctx, a)
	}
	t.orRead = true
	var locked bool
	b := t.batch(driver.Stmt{SQL: t.q.TryLock, Args: []any{a.Lock}, Dest: []any{&locked}})
	if err := t.send(ctx, b); err != nil {
		return driver.Begun{}, err
	}
	return t.claimOrRead(ctx, a, locked)
}

// claimOrRead sends ClaimOrRead: the claim when locked and no partition
// holds the key, and the key's row, if any.
func (t *tx) claimOrRead(ctx context.Context, a *driver.Args, locked bool) (driver.Begun, error) {
	var begun driver.Begun
	s := driver.Scan{Locked: locked}
	b := t.batch(driver.Stmt{SQL: t.q.ClaimOrRead, Args: []any{a.Source, a.EventID, a.Digest, locked}, Dest: s.Columns(&begun.Won)})
	err := t.send(ctx, b)
	begun.Row = s.Row()
	return begun, err
}

// Claim claims the key in this transaction, which holds its lock and has
// found no row: lock-first, that is the claim, and Commit inserts the row.
func (t *tx) Claim(ctx context.Context, a *driver.Args) (bool, error) {
	switch {
	case t.lockFirst:
		t.insertAtEnd = true
		return true, nil
	case t.orRead:
		b, err := t.claimOrRead(ctx, a, true)
		return b.Won, err
	}
	return t.insert(ctx, a)
}

// TakeOver claims a key whose lease ran out: an UPDATE of its row (which
// takes the key's lock itself, but on a table distributed by Citus), whose
// answer is then an UPDATE too.
func (t *tx) TakeOver(ctx context.Context, a *driver.Args) (bool, error) {
	stmt := driver.Stmt{SQL: t.q.TakeOver, Args: []any{a.Source, a.EventID, a.Digest, a.Lock}}
	if t.dist != nil {
		stmt = driver.Stmt{SQL: t.dist.TakeOver, Args: stmt.Args[:3]}
	}
	b := t.batch(stmt)
	err := t.send(ctx, b)
	won := err == nil && b.Stmts[0].N == 1
	if won {
		t.insertAtEnd = false
	}
	return won, err
}

// Wait waits at most d for the key's lock, with lock_timeout set for the
// transaction meanwhile, then reads the key's row and lock with a new
// statement, whose snapshot comes after the wait, which gives the
// transaction back the lock_timeout it had before.
func (t *tx) Wait(ctx context.Context, a *driver.Args, d time.Duration) (driver.Row, error) {
	var (
		old    string
		locked *string
	)
	b := t.batch(driver.Stmt{SQL: t.q.Wait, Args: []any{a.Lock, driver.LockTimeout(d)}, Dest: []any{&old, &locked}})
	if err := t.send(ctx, b); err != nil {
		return driver.Row{}, err
	}
	var (
		s        driver.Scan
		restored string
	)
	b = t.batch(driver.Stmt{SQL: t.q.LookupRestoring, Args: []any{a.Source, a.EventID, a.Lock, old}, Dest: s.Lookup(&restored)})
	err := t.c.Send(ctx, b)
	return s.Row(), err
}

// Commit stores the answer in the key's row and commits: the completed row
// inserted (a key won lock-first; the primary key refuses a second), or an
// UPDATE of the claim.
func (t *tx) Commit(ctx context.Context, a *driver.Args, status int, headers, body []byte) error {
	if t.insertAtEnd {
		q := t.q.InsertCompleted
		err := t.commit(ctx, driver.ErrNotStored, q, q, a.Source, a.EventID, a.Digest, status, string(headers), body)
		if errors.Is(err, driver.ErrTxEnded) {
			// The handler committed (or rolled back) the transaction
			// itself, and lock-first the key has no row yet: record it as
			// claimed without an answer, on the same connection, now out
			// of any transaction.
			b := t.batch(driver.Stmt{SQL: t.q.InsertUnanswered, Args: []any{a.Source, a.EventID, a.Digest}})
			err = errors.Join(err, t.c.Send(ctx, b))
		}
		return err
	}
	complete := t.q.Complete
	if t.orRead {
		complete = t.q.CompleteClaimedNow // one partition, not each
	}
	return t.commit(ctx, driver.ErrNotStored, complete, t.q.CompleteOrFail, a.Source, a.EventID, status, string(headers), body)
}

// Complete is the lease-mode commit: the answer is stored only if token
// still owns the key.
func (t *tx) Complete(ctx context.Context, a *driver.Args, token int64, status int, headers, body []byte) error {
	return t.commit(ctx, driver.ErrFenced, t.q.CompleteLease, t.q.CompleteLeaseOrFail, a.Source, a.EventID, status, string(headers), body, token)
}

// commit stores the answer with one statement that must change one row
// (else the error is none), and commits. Where the Pool pipelines, the
// statement is failing, which fails (a division by zero) when it stores
// nothing, so that the COMMIT in the same round trip cannot commit the
// handler's writes without their answer; otherwise it is store, whose
// count is read before COMMIT is sent. The connection is given back once
// committed.
func (t *tx) commit(ctx context.Context, none error, store, failing string, args ...any) error {
	var err error
	if t.s.pipelines {
		b := t.batch(driver.Stmt{SQL: failing, Args: args})
		b.Commit = true
		err = t.c.Send(ctx, b)
		if driver.SQLState(err) == "22012" {
			err = fmt.Errorf("%w: %w", none, err)
		}
	} else {
		b := t.batch(driver.Stmt{SQL: store, Args: args})
		if err = t.c.Send(ctx, b); err == nil && b.Stmts[0].N != 1 {
			err = fmt.Errorf("%w (%d rows)", none, b.Stmts[0].N)
		}
		if err == nil {
			b = t.batch()
			b.Commit = true
			err = t.c.Send(ctx, b)
		}
	}
	if err != nil {
		return err
	}
	t.open = false
	return t.c.Close(ctx)
}

// Rollback rolls back whatever is open and gives the connection back.
func (t *tx) Rollback(ctx context.Context) error { return t.c.Close(ctx) }
