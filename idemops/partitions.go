package idemops

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/catalog"
)

// What Check and Stats say about a partitioned table's partitions.

// treeSQL lists the relations (relid) of the table named by the parameter
// param and of its partitions, if any: their sizes and counters add up to
// the table's.
func treeSQL(param string) string {
	return `(SELECT to_regclass(` + param + `) AS relid UNION SELECT relid FROM pg_partition_tree(to_regclass(` + param + `))) AS tree`
}

// PartitionReport is what Check found about a partitioned table's
// partitions; all zero for a plain table.
type PartitionReport struct {
	// Partitioned is true when the table is partitioned.
	Partitioned bool
	// Partitions lists its partitions, the oldest first, as
	// TableStats.Partitions does (without their keys).
	Partitions []Partition
	// CurrentPartition is the partition that holds now(), where new claims
	// go; "" when there is none, and every claim fails.
	CurrentPartition string
	// PartitionsAhead counts the partitions wholly after now(), ready for
	// the claims to come; PartitionedUntil is where the last one ends.
	PartitionsAhead  int
	PartitionedUntil time.Time
}

// Partition is one partition of a partitioned table.
type Partition struct {
	Name     string    // in the table's schema
	From, To time.Time // its bounds; zero when unbounded
}

// PartitionStats is one partition with its keys, for Stats.
type PartitionStats struct {
	Partition
	Rows  int64 // committed keys
	Bytes int64 // with its indexes and TOAST
}

// read fills p when t is partitioned and returns the time before which
// keys count as overdue: the end of the newest partition that ended more
// than overdue ago, so one the sweep should have dropped (-infinity when
// none did). For a plain table it returns nil: overdue counts by key.
func (p *PartitionReport) read(ctx context.Context, tx *sql.Tx, t catalog.Table, overdue time.Duration) (any, error) {
	parts, now, err := partitionsAt(ctx, tx, t)
	if err != nil || parts == nil {
		return nil, err
	}
	p.Partitioned = true
	p.Partitions = make([]Partition, 0, len(parts))
	cutoff := now.Add(-overdue)
	before := "-infinity"
	for _, part := range parts {
		p.Partitions = append(p.Partitions, Partition{Name: part.Name, From: part.From, To: part.To})
		switch {
		case part.Default:
			continue
		case !part.From.After(now) && (part.To.IsZero() || part.To.After(now)):
			p.CurrentPartition = part.Name
		case part.From.After(now):
			p.PartitionsAhead++
		case !part.To.IsZero() && !part.To.After(cutoff):
			before = part.To.UTC().Format(time.RFC3339Nano)
		}
		if part.To.After(p.PartitionedUntil) {
			p.PartitionedUntil = part.To
		}
	}
	return before, nil
}

// partitionsAt lists t's partitions, with the database's now(); nil
// partitions (and no error) when t is not partitioned.
func partitionsAt(ctx context.Context, tx *sql.Tx, t catalog.Table) ([]catalog.Partition, time.Time, error) {
	var now time.Time
	kind, err := catalog.RelKind(ctx, tx, t)
	if err != nil || kind != 'p' {
		return nil, now, err
	}
	if err := tx.QueryRowContext(ctx, `SELECT now()`).Scan(&now); err != nil {
		return nil, now, err
	}
	parts, err := catalog.ListPartitions(ctx, tx, t)
	if parts == nil {
		parts = []catalog.Partition{}
	}
	return parts, now, err
}

// partitionFindings are the findings about a partitioned table's
// partitions.
func partitionFindings(r *Report) []Finding {
	if !r.Partitioned {
		return nil
	}
	var out []Finding
	if r.CurrentPartition == "" {
		out = append(out, Finding{Severity: SeverityCritical, Check: "no_current_partition",
			What:   fmt.Sprintf("no partition holds the current time (partitions end %s): every new claim fails and is answered 503", stampOrNone(r.PartitionedUntil)),
			Action: "Run idem migrate (or idem sweep) now: either adds the missing partitions. Then make sure the sweep job runs at least once per partition interval."})
	} else if r.PartitionsAhead < 2 {
		out = append(out, Finding{Severity: SeverityWarning, Check: "few_partitions_ahead",
			What:   fmt.Sprintf("only %d partition(s) are ready after the current one (partitions end %s): when they run out, every new claim fails", r.PartitionsAhead, stampOrNone(r.PartitionedUntil)),
			Action: "Run idem sweep or idem migrate: each keeps partitions ready ahead (-partitions-ahead). Check that the sweep job runs at least once per partition interval."})
	}
	return out
}

func stampOrNone(t time.Time) string {
	if t.IsZero() {
		return "nowhere"
	}
	return t.UTC().Format(time.RFC3339)
}

// readPartitions fills s's partitions, with their keys counted, when t is
// partitioned.
func (s *TableStats) readPartitions(ctx context.Context, tx *sql.Tx, t catalog.Table) error {
	parts, now, err := partitionsAt(ctx, tx, t)
	if err != nil || parts == nil {
		return err
	}
	for _, p := range parts {
		ps := PartitionStats{Partition: Partition{Name: p.Name, From: p.From, To: p.To}}
		err := tx.QueryRowContext(ctx, `SELECT count(*), pg_total_relation_size(to_regclass($1)) FROM `+p.Quoted, p.Quoted).Scan(&ps.Rows, &ps.Bytes)
		if err != nil {
			return err
		}
		if p.From.After(now) {
			s.PartitionsAhead++
		}
		s.Partitions = append(s.Partitions, ps)
	}
	return nil
}
