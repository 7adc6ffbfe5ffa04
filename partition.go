package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Partitioned tables (docs/partitioning.md): the table range-partitioned on
// claimed_at, one partition per interval, each with its own primary key on
// (source, event_id). The claim of a key looks for it in every partition
// under the key's advisory lock (adapter_sql_partitioned.go, idempgx), so a
// key is never run twice while any partition holds it; retention drops
// whole partitions instead of deleting rows.

// Partitioning defaults and bounds.
const (
	// DefaultPartitionsAhead is how many partitions after the current one
	// Migrate and Sweep keep ready when MigrateOptions.PartitionsAhead (or
	// SweepOptions.PartitionsAhead) is 0.
	DefaultPartitionsAhead = 3

	// MinPartitionInterval is the shortest partition interval: every claim
	// looks for its key in every partition, so partitions must stay few.
	MinPartitionInterval = time.Hour
)

// MigrateOptions configures MigrateWith. The zero value of every field
// means its documented default; the zero MigrateOptions is Migrate's.
type MigrateOptions struct {
	// Table is the idempotency table, "" for DefaultTable; a name as
	// Options.Table takes it, refused before any SQL runs otherwise.
	Table string

	// PartitionInterval, when positive, creates a missing table
	// range-partitioned on claimed_at, one partition per interval (aligned
	// to whole multiples of it since the Unix epoch, UTC: 24h partitions
	// run from midnight to midnight UTC), from the current one forward.
	// It must be a whole number of hours. On an existing partitioned table
	// it is the interval of the partitions added from now on; 0 keeps the
	// interval of its newest partition. An existing table that is not
	// partitioned is an error: converting one is a manual procedure
	// (docs/partitioning.md). 0 creates a plain table.
	PartitionInterval time.Duration

	// PartitionsAhead is how many partitions after the current one are
	// kept ready, on a partitioned table, so that a claim never finds no
	// partition for its row. 0 means DefaultPartitionsAhead (3).
	PartitionsAhead int
}

func (o MigrateOptions) validate() error {
	switch {
	case o.PartitionInterval < 0:
		return fmt.Errorf("idem: migrate: partition interval %v is negative", o.PartitionInterval)
	case o.PartitionInterval > 0 && (o.PartitionInterval < MinPartitionInterval || o.PartitionInterval%time.Hour != 0):
		return fmt.Errorf("idem: migrate: partition interval %v must be a whole number of hours, at least 1h", o.PartitionInterval)
	case o.PartitionsAhead < 0:
		return fmt.Errorf("idem: migrate: partitions ahead %d is negative", o.PartitionsAhead)
	}
	return nil
}

func (o MigrateOptions) ahead() int {
	if o.PartitionsAhead == 0 {
		return DefaultPartitionsAhead
	}
	return o.PartitionsAhead
}

// ErrPartitionedIsolation is a claim's error (wrapped in ErrUnavailable,
// answered 503) on a partitioned table when Options.TxOptions asks for
// REPEATABLE READ or SERIALIZABLE: a claim there must take the key's lock
// before the snapshot that looks for the key in every partition is taken,
// which only READ COMMITTED allows (docs/partitioning.md).
var ErrPartitionedIsolation = driver.ErrPartitionedIsolation

// errNotPartitioned: MigrateWith was asked for partitions on a plain table.
var errNotPartitioned = errors.New("the table exists and is not partitioned: convert it by hand (docs/partitioning.md), or migrate without a partition interval")

// relKind returns the table's pg_class.relkind: 'r' plain, 'p'
// partitioned, 0 when it does not exist.
func relKind(ctx context.Context, q queryer, t table) (byte, error) {
	var kind sql.NullString
	err := q.QueryRowContext(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, t.quoted).Scan(&kind)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && kind.String == "") {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return kind.String[0], nil
}

// queryer is a *sql.DB or a *sql.Tx.
type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// migrateLayout decides whether Migrate works on a partitioned table: one
// that is, or a missing one with a partition interval. kind is the table's
// relKind, 0 when it does not exist yet.
func migrateLayout(ctx context.Context, tx *sql.Tx, t table, opts MigrateOptions) (kind byte, partitioned bool, err error) {
	kind, err = relKind(ctx, tx, t)
	switch {
	case err != nil:
		return kind, false, err
	case kind == 'p':
		return kind, true, nil
	case kind != 0 && opts.PartitionInterval > 0:
		return kind, false, errNotPartitioned
	case kind == 0 && opts.PartitionInterval > 0:
		var version int
		if err := tx.QueryRowContext(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
			return kind, false, err
		}
		if version < 140000 {
			// The sweep detaches partitions CONCURRENTLY, so that claims
			// never wait for it: PostgreSQL 14 or later.
			return kind, false, errors.New("partitioned tables need PostgreSQL 14 or later")
		}
		return kind, true, nil
	}
	return kind, false, nil
}

// partition is one partition of a partitioned table. From and To are its
// bounds; zero when unbounded (MINVALUE, MAXVALUE or DEFAULT).
type partition struct {
	Name     string // unquoted, in the parent's schema
	Quoted   string // schema-qualified and quoted
	From, To time.Time
	Pending  bool // a DETACH CONCURRENTLY that did not finish
	Default  bool
}

// partitionsSQL lists the partitions of $1 with their bounds.
const partitionsSQL = `SELECT c.relname, quote_ident(n.nspname) || '.' || quote_ident(c.relname),
       bounds.lo, bounds.hi, i.inhdetachpending, pb.b = 'DEFAULT'
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
` + driver.PartitionBoundsSQL + `
WHERE i.inhparent = to_regclass($1) AND pb.b IS NOT NULL -- NULL: being detached as we read
ORDER BY 3 NULLS FIRST, 1`

// listPartitions returns the partitions of t, the lowest first.
func listPartitions(ctx context.Context, q queryer, t table) ([]partition, error) {
	rows, err := q.QueryContext(ctx, partitionsSQL, t.quoted)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []partition
	for rows.Next() {
		var (
			p        partition
			from, to sql.NullTime
		)
		if err := rows.Scan(&p.Name, &p.Quoted, &from, &to, &p.Pending, &p.Default); err != nil {
			return nil, err
		}
		p.From, p.To = from.Time, to.Time
		out = append(out, p)
	}
	return out, rows.Err()
}

// newestInterval is the width of the bounded partition that ends last, 0
// when there is none.
func newestInterval(parts []partition) time.Duration {
	var newest *partition
	for i := range parts {
		p := &parts[i]
		if !p.From.IsZero() && !p.To.IsZero() && (newest == nil || p.To.After(newest.To)) {
			newest = p
		}
	}
	if newest == nil {
		return 0
	}
	return newest.To.Sub(newest.From)
}

// alignDown is the start of the interval that holds at, counted in whole
// intervals since the Unix epoch.
func alignDown(at time.Time, interval time.Duration) time.Time {
	n := at.UnixNano()
	r := n % int64(interval)
	if r < 0 {
		r += int64(interval)
	}
	return time.Unix(0, n-r).UTC()
}

// ensurePartitions creates the partitions of t that are missing from the
// current interval (by the database's clock) through ahead intervals after
// it, and returns how many it created. interval 0 means that of the newest
// bounded partition; without one, nothing is created. A range partly covered by partitions made by someone else
// (pg_partman, an operator) gets partitions for its gaps only. Each is
// created on its own and then attached, which takes a lock on the table
// that claims do not wait for (CREATE TABLE ... PARTITION OF would).
func ensurePartitions(ctx context.Context, tx *sql.Tx, t table, interval time.Duration, ahead int) (int, error) {
	parts, err := listPartitions(ctx, tx, t)
	if err != nil {
		return 0, err
	}
	if interval == 0 {
		if interval = newestInterval(parts); interval <= 0 {
			// No bounded partition to take the interval from (only one
			// from MINVALUE, as right after a conversion): nothing is
			// added until a migrate with an interval; the check says so.
			return 0, nil
		}
	}
	var now time.Time
	if err := tx.QueryRowContext(ctx, `SELECT now()`).Scan(&now); err != nil {
		return 0, err
	}
	start := alignDown(now, interval)
	end := start.Add(time.Duration(ahead+1) * interval)
	created := 0
	for _, gap := range gaps(parts, start, end, interval) {
		if err := createPartition(ctx, tx, t, gap[0], gap[1]); err != nil {
			return created, err
		}
		created++
	}
	return created, nil
}

// gaps returns the ranges of [start, end) that no partition covers, cut at
// every multiple of interval.
func gaps(parts []partition, start, end time.Time, interval time.Duration) [][2]time.Time {
	var out [][2]time.Time
	for slot := start; slot.Before(end); slot = slot.Add(interval) {
		cur, stop := slot, slot.Add(interval)
		for _, p := range parts { // sorted by From, unbounded first
			if p.Default || p.Pending {
				continue
			}
			lo, hi := p.From, p.To
			if (!hi.IsZero() && !hi.After(cur)) || (!lo.IsZero() && !lo.Before(stop)) {
				continue // wholly before or after what is left of the slot
			}
			if !lo.IsZero() && lo.After(cur) {
				out = append(out, [2]time.Time{cur, lo})
			}
			if hi.IsZero() {
				cur = stop
			} else if hi.After(cur) {
				cur = hi
			}
			if !cur.Before(stop) {
				break
			}
		}
		if cur.Before(stop) {
			out = append(out, [2]time.Time{cur, stop})
		}
	}
	return out
}

// partitionName is "<table>_p<YYYYMMDD_HHMM>" for a partition from from,
// with the table's name cut and hashed as indexName does when that would
// not fit in 63 bytes.
func partitionName(rel string, from time.Time) string {
	suffix := "_p" + from.UTC().Format("20060102_1504")
	if from.Second() != 0 || from.Nanosecond() != 0 {
		suffix = "_p" + from.UTC().Format("20060102_150405.000000")
	}
	if len(rel)+len(suffix) <= 63 {
		return rel + suffix
	}
	h := uint32(lockID(rel, "", ""))
	return fmt.Sprintf("%s_%08x%s", rel[:63-len(suffix)-9], h, suffix)
}

// timestampLiteral renders at as a timestamptz literal.
func timestampLiteral(at time.Time) string {
	if at.IsZero() {
		return "MINVALUE"
	}
	return "'" + at.UTC().Format("2006-01-02 15:04:05.999999") + "+00'"
}

// createPartition creates the partition [from, to) of t (from zero: from
// MINVALUE) with its primary key, and attaches it.
func createPartition(ctx context.Context, tx *sql.Tx, t table, from, to time.Time) error {
	name := quoteIdent(partitionName(t.rel, from))
	if t.schema != "" {
		name = quoteIdent(t.schema) + "." + name
	}
	for _, stmt := range []string{
		`CREATE TABLE ` + name + ` (LIKE ` + t.quoted + ` INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMPRESSION)`,
		`ALTER TABLE ` + name + ` ADD PRIMARY KEY (source, event_id)`,
		`ALTER TABLE ` + t.quoted + ` ATTACH PARTITION ` + name + ` FOR VALUES FROM (` + timestampLiteral(from) + `) TO (` + timestampLiteral(to) + `)`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("partition %s: %w", name, err)
		}
	}
	return nil
}

// keepPartitionsAhead adds the missing partitions of t through ahead
// intervals after the current one, in one transaction under Migrate's
// lock, with the interval of its newest partition.
func keepPartitionsAhead(ctx context.Context, db *sql.DB, t table, ahead int) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLock(t)); err != nil {
		return 0, err
	}
	n, err := ensurePartitions(ctx, tx, t, 0, ahead)
	if err != nil {
		return 0, err
	}
	return n, tx.Commit()
}

// dropPartition removes a partition: detached CONCURRENTLY (claims go on
// meanwhile; it waits for the transactions that use the table to end),
// counted, and dropped. A detach that an earlier run left pending is
// finished instead. It returns the keys the partition held. An error
// wrapping errDetached means the partition was detached but not dropped.
func dropPartition(ctx context.Context, db *sql.DB, t table, p partition) (int64, error) {
	detach := `ALTER TABLE ` + t.quoted + ` DETACH PARTITION ` + p.Quoted + ` CONCURRENTLY`
	if p.Pending {
		detach = `ALTER TABLE ` + t.quoted + ` DETACH PARTITION ` + p.Quoted + ` FINALIZE`
	}
	if _, err := db.ExecContext(ctx, detach); err != nil {
		return 0, err
	}
	// Detached: the table is this sweep's alone now, but another sweep
	// that listed it may still try to detach it, and one of the two can be
	// chosen as a deadlock's victim: try again.
	var n int64
	err := retryDeadlocks(func() error { return db.QueryRowContext(ctx, `SELECT count(*) FROM `+p.Quoted).Scan(&n) })
	if err == nil {
		err = retryDeadlocks(func() error {
			_, err := db.ExecContext(ctx, `DROP TABLE `+p.Quoted)
			return err
		})
	}
	if err != nil {
		return 0, fmt.Errorf("%w (DROP TABLE %s by hand): %w", errDetached, p.Quoted, err)
	}
	return n, nil
}

// errDetached: a partition was detached but could not be dropped.
var errDetached = errors.New("the partition is detached but not dropped")

// retryDeadlocks runs f up to three times while it fails with a deadlock.
func retryDeadlocks(f func() error) error {
	var err error
	for range 3 {
		if err = f(); driver.SQLState(err) != "40P01" {
			return err
		}
	}
	return err
}

// runPartitions sweeps a partitioned table: it keeps s.ahead partitions
// ready after the current one, then drops every partition that ends at or
// before now() minus the retention (by the database's clock), so wholly
// older than the retention: a partition that holds a key claimed within
// the retention ends after that key and is kept. Keys of the partition
// that straddles the cutoff live until it ends, up to one interval past
// the retention. BatchSize and MaxBatches do not apply; Pause is waited
// between two partitions.
func (s *sweeper) runPartitions(ctx context.Context, db *sql.DB) (res SweepResult, err error) {
	fail := func(err error) (SweepResult, error) {
		return res, fmt.Errorf("idem: sweep %s: %w", s.table.name, err)
	}
	if res.PartitionsCreated, err = keepPartitionsAhead(ctx, db, s.table, s.ahead); err != nil {
		return fail(fmt.Errorf("adding partitions ahead: %w", err))
	}
	parts, err := listPartitions(ctx, db, s.table)
	if err != nil {
		return fail(err)
	}
	var cutoff time.Time
	if err := db.QueryRowContext(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, s.retention.Microseconds()).Scan(&cutoff); err != nil {
		return fail(err)
	}
	// A detach an earlier run left pending comes first: PostgreSQL starts
	// no other on the table until it is finished.
	sort.SliceStable(parts, func(i, j int) bool { return parts[i].Pending && !parts[j].Pending })
	for _, p := range parts {
		if p.Default || p.To.IsZero() || p.To.After(cutoff) {
			continue
		}
		if res.PartitionsDropped > 0 && s.pause > 0 {
			if err := sleep(ctx, s.pause); err != nil {
				return fail(err)
			}
		}
		n, err := dropPartition(ctx, db, s.table, p)
		if err != nil {
			if errors.Is(err, errDetached) {
				return fail(err)
			}
			switch other, cerr := anotherSweep(ctx, db, s.table, p, parts); {
			case cerr == nil && other == otherTookIt:
				continue
			case cerr == nil && (other == otherIsDetaching || driver.SQLState(err) == "40P01"):
				// PostgreSQL detaches one partition of a table at a time
				// (and a deadlock between two detaches leaves one of them
				// going): the other sweep goes on with the rest.
				if s.logger != nil {
					s.logger.LogAttrs(ctx, slog.LevelInfo, "idem: sweep stops: another sweep is dropping partitions of the table",
						slog.String("table", s.table.name))
				}
				return res, nil
			}
			return fail(fmt.Errorf("dropping partition %s: %w", p.Quoted, err))
		}
		res.Removed += n
		res.PartitionsDropped++
		if s.logger != nil {
			s.logger.LogAttrs(ctx, slog.LevelDebug, "idem: sweep dropped a partition",
				slog.String("table", s.table.name), slog.String("partition", p.Name), slog.Int64("removed", n))
		}
	}
	return res, nil
}

// What another sweep of the same table, running at the same time, did to
// a partition this one failed to detach.
const (
	otherNone        = iota // nothing: the failure is this sweep's own
	otherTookIt             // the partition is gone or being detached
	otherIsDetaching        // another partition is being detached now
)

// anotherSweep tells why detaching p failed, from the partitions now and
// those listed (before) when the sweep began.
func anotherSweep(ctx context.Context, db *sql.DB, t table, p partition, before []partition) (int, error) {
	now, err := listPartitions(ctx, db, t)
	if err != nil {
		return otherNone, err
	}
	pending := map[string]bool{}
	for _, b := range before {
		pending[b.Name] = b.Pending
	}
	attached, newlyPending, present := false, false, map[string]bool{}
	for _, q := range now {
		present[q.Name] = true
		if q.Name == p.Name && !q.Pending {
			attached = true
		}
		if q.Pending && !pending[q.Name] {
			newlyPending = true
		}
	}
	// Another partition listed before and gone now was detached and
	// dropped meanwhile: by the time this looks, the other sweep may have
	// finished the detach that made this one fail.
	gone := false
	for _, b := range before {
		if b.Name != p.Name && !present[b.Name] {
			gone = true
		}
	}
	switch {
	case !attached:
		return otherTookIt, nil
	case newlyPending || gone:
		return otherIsDetaching, nil
	}
	return otherNone, nil
}
