package idemui

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// snapshot is what the overview shows, taken in the background.
type snapshot struct {
	TakenAt time.Time
	Took    time.Duration
	Report  *idemops.Report     // health: counts, in flight, partitions, durability, findings
	Stats   *idemops.TableStats // per source, partitions with sizes
	Hours   []hourCount         // claims per hour over the retention, oldest first
	Latency latency             // completion latency of the keys completed in the last 24h
	Sources []string            // the sources of Stats, for the search form
	// Open are the newest keys without an answer (unanswered, leased,
	// lease expired), newest first, at most maxOpen: the problem lists
	// render from them, since finding rare keys on a large table takes a
	// scan. OpenCapped is true when there were more.
	Open       []idemops.KeyInfo
	OpenCapped bool
	Err        string // the last refresh's error, if it failed
	Window     time.Duration
	MaxHour    int64
	LastHour   time.Time
}

type hourCount struct {
	Hour  time.Time
	Count int64
}

// latency is completion latency, claimed_at to completed_at.
type latency struct {
	Keys          int64
	P50, P95, P99 time.Duration
}

// maxOpen bounds the keys without an answer a snapshot keeps, per kind
// (stuck, leased).
const maxOpen = 1000

// takeSnapshot reads what the overview and the problem lists show:
// idemops.Check and idemops.Stats (each one pass over the table), the
// newest keys without an answer (idemops.ListKeys, which reads back from
// now until it has found them: one pass at most), and one pass over the
// retention window for the chart and the latency percentiles.
func takeSnapshot(ctx context.Context, db *sql.DB, opts Options) (*snapshot, error) {
	start := time.Now()
	s := &snapshot{Window: opts.Retention}
	var err error
	if s.Report, err = idemops.Check(ctx, db, idemops.CheckOptions{Table: opts.Table, Retention: opts.Retention, Horizon: opts.Horizon}); err != nil {
		return nil, err
	}
	if s.Stats, err = idemops.Stats(ctx, db, idemops.StatsOptions{Table: opts.Table, MaxSources: 100}); err != nil {
		return nil, err
	}
	for _, src := range s.Stats.Sources {
		s.Sources = append(s.Sources, src.Source)
	}
	for _, state := range []idemops.ListState{idemops.ListStuck, idemops.ListLeased} {
		keys, err := idemops.ListKeys(ctx, db, idemops.ListOptions{Table: opts.Table, State: state, Limit: maxOpen})
		if err != nil {
			return nil, err
		}
		s.Open = append(s.Open, keys...)
		s.OpenCapped = s.OpenCapped || len(keys) == maxOpen
	}
	sort.SliceStable(s.Open, func(i, j int) bool { return s.Open[i].ClaimedAt.After(s.Open[j].ClaimedAt) })
	if err := readChart(ctx, db, opts, s); err != nil {
		return nil, fmt.Errorf("idem: idemui: chart: %w", err)
	}
	s.TakenAt, s.Took = s.Report.CheckedAt, time.Since(start)
	return s, nil
}

// readChart counts the claims per hour over the retention window, and the
// latency percentiles of the last day's completions, in one read-only
// snapshot; each query ranges over claimed_at, which the table's index and
// partitions serve.
func readChart(ctx context.Context, db *sql.DB, opts Options, s *snapshot) error {
	table := quoteTable(opts.Table)
	tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true, Isolation: sql.LevelRepeatableRead})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	var now time.Time
	if err := tx.QueryRowContext(ctx, `SELECT date_trunc('hour', now())`).Scan(&now); err != nil {
		return err
	}
	hours := int(opts.Retention / time.Hour)
	if hours < 1 {
		hours = 1
	}
	first := now.Add(-time.Duration(hours-1) * time.Hour)
	counts := make([]int64, hours)
	rows, err := tx.QueryContext(ctx, `SELECT date_trunc('hour', claimed_at), count(*) FROM `+table+`
WHERE claimed_at >= $1 GROUP BY 1`, first)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			h time.Time
			n int64
		)
		if err := rows.Scan(&h, &n); err != nil {
			return err
		}
		if i := int(h.Sub(first) / time.Hour); i >= 0 && i < hours {
			counts[i] += n
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	s.Hours = make([]hourCount, hours)
	for i := range counts {
		s.Hours[i] = hourCount{Hour: first.Add(time.Duration(i) * time.Hour), Count: counts[i]}
		s.MaxHour = max(s.MaxHour, counts[i])
	}
	s.LastHour = now
	var p50, p95, p99 sql.NullFloat64
	err = tx.QueryRowContext(ctx, `WITH l AS (SELECT extract(epoch FROM completed_at - claimed_at)::float8 AS s FROM `+table+`
    WHERE claimed_at >= now() - interval '1 day' AND completed_at IS NOT NULL)
SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY s), percentile_cont(0.95) WITHIN GROUP (ORDER BY s),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY s) FROM l`).Scan(&s.Latency.Keys, &p50, &p95, &p99)
	if err != nil {
		return err
	}
	s.Latency.P50, s.Latency.P95, s.Latency.P99 = secs(p50), secs(p95), secs(p99)
	return tx.Commit()
}

// quoteTable quotes a table name that idemops has validated ("name" or
// "schema.name", each of a-z, 0-9 and _), "" for the default table.
func quoteTable(name string) string {
	if name == "" {
		name = idem.DefaultTable
	}
	return `"` + strings.ReplaceAll(name, ".", `"."`) + `"`
}

func secs(f sql.NullFloat64) time.Duration {
	return time.Duration(f.Float64 * float64(time.Second))
}

// openKeys returns the first limit keys of the snapshot in state (not
// ListAll), of source when not "", newest first.
func (s *snapshot) openKeys(state idemops.ListState, source string, limit int) []idemops.KeyInfo {
	var out []idemops.KeyInfo
	for _, k := range s.Open {
		if len(out) == limit {
			break
		}
		if source != "" && k.Key.Source != source {
			continue
		}
		match := false
		switch state {
		case idemops.ListStuck:
			match = k.State == idemops.KeyUnanswered || k.State == idemops.KeyLeaseExpired
		case idemops.ListUnanswered:
			match = k.State == idemops.KeyUnanswered
		case idemops.ListExpired:
			match = k.State == idemops.KeyLeaseExpired
		case idemops.ListLeased:
			match = k.State == idemops.KeyLeased
		}
		if match {
			out = append(out, k)
		}
	}
	return out
}
