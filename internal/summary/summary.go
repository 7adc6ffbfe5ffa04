// Package summary keeps summaries of a partitioned table's past
// partitions (Bloom filters of their keys, refreshed in the background),
// which let a claim skip the partitions that cannot hold its key
// (docs/partitioning.md). Both adapters use it through the Querier they
// give it; nothing here is public API.
package summary

import (
	"context"
	"errors"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Summaries let a claim on a partitioned table skip the partitions before
// the current one (docs/partitioning.md, "Summaries of past partitions").
//
// A claim dates its row by its transaction's start (claimed_at = now()),
// and a takeover moves a row to the partition of its own start, so no key
// enters a partition once every transaction that began before its end has
// ended: the partition is closed. Summaries reads the keys of each closed
// partition once and keeps them as a Bloom filter. A claim whose key every
// past partition's filter rules out can then claim on the current
// partition as on a plain table (Fast): that partition has its own primary
// key, and every claim in flight writes there, the earlier partitions
// being closed. A claim whose key some filters do not rule out claims
// there too, after looking for the key in those partitions, in the same
// statement (the lock need not come first: nothing changes in a closed
// partition). Without summaries a claim takes the lock-first claim across
// every partition.
//
// A partition is taken as closed when, at a time margin past its end, the
// transactions running (their virtualxid locks in pg_locks) have all
// ended: one that began before its end had to be among them, unless it
// took longer than the margin between its first statement's arrival and its
// start. The transactions are listed once for every partition that ended
// by then, as CREATE INDEX CONCURRENTLY waits for them.
type Summaries struct {
	query Querier
	table string // the parent, quoted
	seed  maphash.Seed

	// margin keeps fast claims away from a partition's bounds, and a
	// partition from being summarised until that long after its end;
	// every is how often the partitions are listed again (a list older
	// than twice that is not used); drain is how long a refresh waits for
	// the listed transactions to end before it leaves them to the next
	// one: Set.
	margin, every, drain atomic.Int64
	off                  atomic.Bool
	skew                 atomic.Int64 // Skew

	state   atomic.Pointer[summaryState]
	all     driver.Queries // the table's statements
	fast    atomic.Int64   // claims Fast sent to the current partition as plain
	narrow  atomic.Int64   // and there after looking in some past ones
	answers atomic.Int64   // answers read by Answered
	busy    atomic.Bool
	mu      sync.Mutex // one refresh at a time
	wg      sync.WaitGroup
}

// Lazy makes a table's Summaries on first use: an adapter's,
// which learns on its first claim whether its table is partitioned.
type Lazy struct {
	once sync.Once
	s    *Summaries
}

// Get returns the summaries of the table quoted, read through query.
func (l *Lazy) Get(quoted string, query Querier) *Summaries {
	l.once.Do(func() { l.s = New(quoted, query) })
	return l.s
}

// ClaimAgainEverywhere reports whether a claim that Fast sent to some
// partitions failed, before any handler, for a reason the lock-first claim
// across every partition does not meet: ErrOutside, or, by the error's
// SQLSTATE, check_violation (23514), the row written to a partition whose
// bounds do not hold it (the claim's transaction began after the current
// partition's end); undefined_table (42P01), a past partition dropped
// since the last listing; invalid_column_reference (42P10), a current
// partition without the primary key ON CONFLICT needs.
func ClaimAgainEverywhere(err error) bool {
	if errors.Is(err, ErrOutside) {
		return true
	}
	switch driver.SQLState(err) {
	case "23514", "42P01", "42P10":
		return true
	}
	return false
}

// ErrOutside is the error of a claim Fast sent to the current partition
// whose transaction began outside it (Current.Holds).
var ErrOutside = errors.New("the claim's transaction began outside the current partition")

// Rows are a query's rows, as *sql.Rows and pgx.Rows have them.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
}

// EachRow calls each with every row's Scan, for an adapter's Querier.
func EachRow(rows Rows, each func(scan func(dest ...any) error) error) error {
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// Querier runs query with args and calls each with every row's Scan: how
// Summaries reads the catalog and a partition's keys through an adapter.
type Querier func(ctx context.Context, query string, args []any, each func(scan func(dest ...any) error) error) error

// New returns the summaries of the partitioned table quoted,
// read through query. Nothing is read until the first Fast.
func New(quoted string, query Querier) *Summaries {
	s := &Summaries{query: query, table: quoted, seed: maphash.MakeSeed(), all: driver.NewQueries(quoted)}
	s.Set(time.Minute, 10*time.Second, 2*time.Second)
	return s
}

func (s *Summaries) config() (margin, every, drain time.Duration) {
	return time.Duration(s.margin.Load()), time.Duration(s.every.Load()), time.Duration(s.drain.Load())
}

type summaryState struct {
	read   time.Time     // when listed, by this process's clock
	offset time.Duration // the database's clock minus this process's
	usable bool          // every past partition has a filter, no default partition

	current       *Current
	filters       []*bloom
	pastQuoted    []string // the partitions of filters
	narrowed      sync.Map // a bit set of filters' indexes -> *Current
	narrowedCount atomic.Int64
	built         map[int64]*bloom // by partition OID
	closedBefore  time.Time        // a partition that ended by then is closed
	pendingAt     time.Time        // transactions listed at that time,
	pending       string           // still to end (virtualxids, comma-separated)
}

// Current is the current partition of a partitioned table, its bounds,
// and the statements of a claim there (Fast).
type Current struct {
	// Queries are the plain table's, on the current partition. When some
	// past partitions' summaries do not rule the key out, ClaimPast claims
	// after looking for the key in those, and the lookups read them too
	// (driver.PartitionQueries).
	driver.Queries
	From, To time.Time

	quoted   string
	answered string // Answered's statement, with ClaimPast
}

// Holds reports whether a claim whose transaction began at (by the
// database's clock) writes its row to c: a claim that takes longer than
// the margin between Fast and its BEGIN may not.
func (c *Current) Holds(at time.Time) bool { return !at.Before(c.From) && at.Before(c.To) }

// TryLockAt is Queries.TryLock that also returns the transaction's start,
// for Current.Holds.
const TryLockAt = `SELECT pg_try_advisory_xact_lock($1), now()`

// Fast returns how a claim of a, at now by this process's clock, may skip
// past partitions: on the current partition as on a plain table, after
// looking for the key in the past partitions that may hold it, if any
// (Current.ClaimPast); nil when it must claim lock-first across every
// partition. It starts a refresh of the summaries in the background when
// they are due.
func (s *Summaries) Fast(a *driver.Args, now time.Time) *Current {
	c := s.pick(a, now)
	switch {
	case c == nil:
	case c.ClaimPast == "":
		s.fast.Add(1)
	default:
		s.narrow.Add(1)
	}
	return c
}

// Answered returns the key's answer when a past partition that may hold it
// (by the summaries, as Fast) does, read with one statement outside any
// transaction: a closed partition takes no new row and an answered row
// never changes, so what any snapshot finds there is final, without the
// key's lock. ok is false when there is no such row or no summaries to
// say where to look (a past partition dropped since the last listing
// counts as none); the claim then goes on in a transaction.
func (s *Summaries) Answered(ctx context.Context, a *driver.Args, now time.Time) (row driver.Row, ok bool, err error) {
	c := s.pick(a, now)
	if c == nil || c.answered == "" {
		return row, false, nil
	}
	err = s.query(ctx, c.answered, []any{a.Source, a.EventID}, func(scan func(...any) error) error {
		row.State, ok = driver.Completed, true
		return scan(&row.Digest, &row.Status, &row.Headers, &row.Body)
	})
	switch {
	case err != nil && ClaimAgainEverywhere(err):
		return driver.Row{}, false, nil
	case err != nil:
		return driver.Row{}, false, err
	case ok:
		s.answers.Add(1)
	}
	return row, ok, nil
}

// pick is Fast, uncounted.
func (s *Summaries) pick(a *driver.Args, now time.Time) *Current {
	if s.off.Load() {
		return nil
	}
	margin, every, _ := s.config()
	now = now.Add(time.Duration(s.skew.Load()))
	st := s.state.Load()
	if st == nil || now.Sub(st.read) >= every {
		s.refreshInBackground()
	}
	if st == nil || !st.usable || now.Sub(st.read) >= 2*every {
		return nil
	}
	db := now.Add(st.offset)
	if db.Before(st.current.From.Add(margin)) || !db.Before(st.current.To.Add(-margin)) {
		return nil
	}
	h := s.hash(a)
	var maybe uint64 // the past partitions that may hold the key
	for i, f := range st.filters {
		if f.has(h) {
			if i >= 64 {
				return nil
			}
			maybe |= 1 << i
		}
	}
	if maybe == 0 {
		return st.current
	}
	if c, ok := st.narrowed.Load(maybe); ok {
		return c.(*Current)
	}
	if st.narrowedCount.Add(1) > maxNarrowed {
		return nil
	}
	var past []string
	for i := range st.filters {
		if maybe&(1<<i) != 0 {
			past = append(past, st.pastQuoted[i])
		}
	}
	c := &Current{Queries: driver.PartitionQueries(s.all, st.current.quoted, past), From: st.current.From, To: st.current.To,
		answered: driver.AnsweredIn(past)}
	st.narrowed.Store(maybe, c)
	return c
}

// maxNarrowed bounds the sets of statements kept for claims that look in
// some past partitions: one per set of partitions (mostly one partition,
// the filters' false positives aside).
const maxNarrowed = 1024

// Summarised is a driver of a table that may be partitioned.
type Summarised interface {
	// Summaries are those of the driver's table.
	Summaries() *Summaries
}

func (s *Summaries) hash(a *driver.Args) uint64 {
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(a.Source)
	h.WriteByte(0)
	h.WriteString(a.EventID)
	return h.Sum64()
}
