package summary

import (
	"context"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Reading the partitions: which are closed, and the keys of each (Refresh),
// in the background when Fast finds the summaries due.

func (s *Summaries) refreshInBackground() {
	if !s.busy.CompareAndSwap(false, true) {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.busy.Store(false)
		// Long enough to read the keys of every past partition the first
		// time; the claims go on lock-first meanwhile.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		_ = s.Refresh(ctx)
	}()
}

// Wait waits for a refresh running in the background to end.
func (s *Summaries) Wait() { s.wg.Wait() }

// summaryPartitionsSQL lists the partitions of $1 with their bounds in
// microseconds since the epoch (the least and greatest int8 for MINVALUE
// and MAXVALUE), after the database's clock; one row with OID 0 when
// there is none.
const summaryPartitionsSQL = `SELECT floor(extract(epoch FROM clock_timestamp()) * 1e6)::int8,
       coalesce(p.oid, 0), coalesce(p.quoted, ''), coalesce(p.dflt, false), coalesce(p.pending, false),
       coalesce(p.lo, -9223372036854775808), coalesce(p.hi, 9223372036854775807)
FROM (VALUES (1)) AS one LEFT JOIN (
    SELECT c.oid::int8 AS oid, quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS quoted,
           pb.b = 'DEFAULT' AS dflt, i.inhdetachpending AS pending,
           floor(extract(epoch FROM bounds.lo) * 1e6)::int8 AS lo, floor(extract(epoch FROM bounds.hi) * 1e6)::int8 AS hi
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    ` + driver.PartitionBoundsSQL + `
    WHERE i.inhparent = to_regclass($1) AND pb.b IS NOT NULL) AS p ON true`

// runningSQL lists the transactions running in this database (but this
// one) after the time it returns: the statement's start, before the list
// is read.
const runningSQL = `SELECT floor(extract(epoch FROM statement_timestamp()) * 1e6)::int8,
       coalesce(string_agg(l.virtualxid::text, ','), '')
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'virtualxid' AND l.pid <> pg_backend_pid()
  AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())`

// stillRunningSQL counts the transactions of $1 (as runningSQL lists
// them) still running.
const stillRunningSQL = `SELECT count(*) FROM pg_locks
WHERE locktype = 'virtualxid' AND virtualxid::text = ANY(string_to_array($1, ','))`

type listedPartition struct {
	oid             int64
	quoted          string
	dflt, pending   bool
	from, to        time.Time
	unbounded, open bool // from MINVALUE, to MAXVALUE
}

func micros(us int64) time.Time { return time.UnixMicro(us) }

// Refresh lists the partitions again, finds those that have closed, and
// reads the keys of each closed partition not summarised yet.
func (s *Summaries) Refresh(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	margin, _, _ := s.config()
	prev := s.state.Load()
	next := &summaryState{built: map[int64]*bloom{}}
	if prev != nil {
		next.closedBefore, next.pendingAt, next.pending = prev.closedBefore, prev.pendingAt, prev.pending
	}
	var (
		parts []listedPartition
		dbNow int64
	)
	before := time.Now()
	err := s.query(ctx, summaryPartitionsSQL, []any{s.table}, func(scan func(...any) error) error {
		var p listedPartition
		var lo, hi int64
		if err := scan(&dbNow, &p.oid, &p.quoted, &p.dflt, &p.pending, &lo, &hi); err != nil {
			return err
		}
		p.unbounded, p.open = lo == -1<<63, hi == 1<<63-1
		p.from, p.to = micros(lo), micros(hi)
		if p.oid != 0 {
			parts = append(parts, p)
		}
		return nil
	})
	if err != nil {
		if prev != nil {
			next.built = prev.built
		}
		next.read = time.Now() // the next try in Every, claims lock-first meanwhile
		s.state.Store(next)
		return err
	}
	after := time.Now()
	next.read = after
	next.offset = micros(dbNow).Sub(before.Add(after.Sub(before) / 2))
	defer func() { s.state.Store(next) }()

	now := micros(dbNow)
	var current *listedPartition
	for i := range parts {
		p := &parts[i]
		if p.dflt {
			return nil // a default partition takes rows at any time: never closed
		}
		if !p.pending && !p.unbounded && !p.open && !now.Before(p.from) && now.Before(p.to) {
			current = p
		}
	}
	if current == nil {
		return nil
	}
	next.current = &Current{Queries: driver.NewQueries(current.quoted), From: current.from, To: current.to, quoted: current.quoted}

	// Which past partitions are closed: the transactions listed last time
	// may have ended; if a partition still waits, list them again.
	var waiting bool
	for _, p := range parts {
		if !p.pending && !p.to.After(current.from) && p.to.After(next.closedBefore) &&
			!p.to.Add(margin).After(now) {
			waiting = true // it ended a margin ago or more, and is not closed yet
		}
	}
	if waiting {
		if err := s.close(ctx, next, margin); err != nil {
			return err
		}
	}
	usable := true
	for _, p := range parts {
		if p.pending || p.to.After(current.from) {
			continue // being detached (expired keys), or not in the past
		}
		f := prev.builtFor(p.oid)
		if f == nil {
			if p.to.After(next.closedBefore) {
				usable = false // not closed yet: no fast claims
				continue
			}
			if f, err = s.build(ctx, p.quoted); err != nil {
				return err
			}
		}
		next.built[p.oid] = f
		next.filters = append(next.filters, f)
		next.pastQuoted = append(next.pastQuoted, p.quoted)
	}
	next.usable = usable
	return nil
}

func (st *summaryState) builtFor(oid int64) *bloom {
	if st == nil {
		return nil
	}
	return st.built[oid]
}

// close moves next.closedBefore on: to the time transactions were listed,
// less margin, once they have all ended (waiting up to drain for them).
func (s *Summaries) close(ctx context.Context, next *summaryState, margin time.Duration) error {
	if next.pendingAt.IsZero() {
		var at int64
		err := s.query(ctx, runningSQL, nil, func(scan func(...any) error) error {
			return scan(&at, &next.pending)
		})
		if err != nil {
			return err
		}
		next.pendingAt = micros(at)
	}
	_, _, drain := s.config()
	deadline := time.Now().Add(drain)
	for {
		var n int64 = 0
		if next.pending != "" {
			err := s.query(ctx, stillRunningSQL, []any{next.pending}, func(scan func(...any) error) error {
				return scan(&n)
			})
			if err != nil {
				return err
			}
		}
		if n == 0 {
			if c := next.pendingAt.Add(-margin); c.After(next.closedBefore) {
				next.closedBefore = c
			}
			next.pending, next.pendingAt = "", time.Time{}
			return nil
		}
		if !time.Now().Before(deadline) {
			return nil // the next refresh looks again
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// build reads the keys of the partition quoted into a filter.
func (s *Summaries) build(ctx context.Context, quoted string) (*bloom, error) {
	var hashes []uint64
	var a driver.Args
	err := s.query(ctx, `SELECT source, event_id FROM `+quoted, nil, func(scan func(...any) error) error {
		if err := scan(&a.Source, &a.EventID); err != nil {
			return err
		}
		hashes = append(hashes, s.hash(&a))
		return nil
	})
	if err != nil {
		return nil, err
	}
	f := newBloom(len(hashes))
	for _, h := range hashes {
		f.add(h)
	}
	return f, nil
}
