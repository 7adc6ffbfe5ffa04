package catalog

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/driver"
)

// Partitioned tables (docs/partitioning.md): the table range-partitioned on
// claimed_at, one partition per interval, each with its own primary key on
// (source, event_id). A claim takes the key's advisory lock before it looks
// for the key in the past partitions (internal/driver), so a key is never
// run twice while any partition holds it; retention drops whole partitions
// instead of deleting rows.

// Partition is one partition of a partitioned table. From and To are its
// bounds; zero when unbounded (MINVALUE, MAXVALUE or DEFAULT).
type Partition struct {
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

// ListPartitions returns the partitions of t, the lowest first.
func ListPartitions(ctx context.Context, q Queryer, t Table) ([]Partition, error) {
	rows, err := q.QueryContext(ctx, partitionsSQL, t.Quoted)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Partition
	for rows.Next() {
		var (
			p        Partition
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
func newestInterval(parts []Partition) time.Duration {
	var newest *Partition
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

// EnsurePartitions creates the partitions of t that are missing from the
// current interval (by the database's clock) through ahead intervals after
// it, and returns how many it created. interval 0 means that of the newest
// bounded partition; without one, nothing is created. A range partly
// covered by partitions made by someone else (pg_partman, an operator) gets
// partitions for its gaps only. Each is created on its own and then
// attached, which takes a lock on the table that claims do not wait for
// (CREATE TABLE ... PARTITION OF would).
func EnsurePartitions(ctx context.Context, tx *sql.Tx, t Table, interval time.Duration, ahead int) (int, error) {
	parts, err := ListPartitions(ctx, tx, t)
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
		if err := CreatePartition(ctx, tx, t, gap[0], gap[1]); err != nil {
			return created, err
		}
		created++
	}
	return created, nil
}

// gaps returns the ranges of [start, end) that no partition covers, cut at
// every multiple of interval.
func gaps(parts []Partition, start, end time.Time, interval time.Duration) [][2]time.Time {
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

// PartitionName is "<table>_p<YYYYMMDD_HHMM>" for a partition from from,
// with the table's name cut and hashed as the index's name is when that
// would not fit in 63 bytes.
func PartitionName(rel string, from time.Time) string {
	suffix := "_p" + from.UTC().Format("20060102_1504")
	if from.Second() != 0 || from.Nanosecond() != 0 {
		suffix = "_p" + from.UTC().Format("20060102_150405.000000")
	}
	return fitName(rel, suffix)
}

// timestampLiteral renders at as a timestamptz literal.
func timestampLiteral(at time.Time) string {
	if at.IsZero() {
		return "MINVALUE"
	}
	return "'" + at.UTC().Format("2006-01-02 15:04:05.999999") + "+00'"
}

// CreatePartition creates the partition [from, to) of t (from zero: from
// MINVALUE) with its primary key, and attaches it.
func CreatePartition(ctx context.Context, tx *sql.Tx, t Table, from, to time.Time) error {
	name := QuoteIdent(PartitionName(t.Rel, from))
	if t.Schema != "" {
		name = QuoteIdent(t.Schema) + "." + name
	}
	for _, stmt := range []string{
		`CREATE TABLE ` + name + ` (LIKE ` + t.Quoted + ` INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMPRESSION)`,
		`ALTER TABLE ` + name + ` ADD PRIMARY KEY (source, event_id)`,
		`ALTER TABLE ` + t.Quoted + ` ATTACH PARTITION ` + name + ` FOR VALUES FROM (` + timestampLiteral(from) + `) TO (` + timestampLiteral(to) + `)`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("partition %s: %w", name, err)
		}
	}
	return nil
}

// KeepPartitionsAhead adds the missing partitions of t through ahead
// intervals after the current one, in one transaction under Migrate's
// lock, with the interval of its newest partition.
func KeepPartitionsAhead(ctx context.Context, db *sql.DB, t Table, ahead int) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", MigrateLock(t)); err != nil {
		return 0, err
	}
	n, err := EnsurePartitions(ctx, tx, t, 0, ahead)
	if err != nil {
		return 0, err
	}
	return n, tx.Commit()
}
