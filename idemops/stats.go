package idemops

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"time"

	"github.com/pgidem/idem/internal/catalog"
)

// StatsOptions configures Stats. The zero value of every field means its
// documented default.
type StatsOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it.
	Table string
	// MaxSources is how many sources TableStats lists, the busiest first.
	// 0 means 100.
	MaxSources int
}

// SourceStats are the committed keys of one source.
type SourceStats struct {
	Source     string
	Completed  int64     // keys with a stored answer
	Unanswered int64     // keys committed without an answer (see Check)
	Leases     int64     // lease-mode keys in progress, live or expired
	Oldest     time.Time // claimed_at of its oldest key
	Newest     time.Time // claimed_at of its newest key
}

// TableStats describes the idempotency table.
type TableStats struct {
	Table      string
	Rows       int64 // committed keys
	Completed  int64
	Unanswered int64
	// Lease mode: keys in progress whose lease still runs, and those whose
	// lease ran out without an answer (crashed originals; see Check).
	LiveLeases, ExpiredLeases int64
	// InFlight counts the claims in flight: their keys are uncommitted
	// and invisible, so they are counted by session, not by source.
	InFlight   int
	Oldest     time.Time // zero when the table is empty
	Newest     time.Time
	TableBytes int64
	// Partitions lists a partitioned table's partitions, the oldest first,
	// with their keys; PartitionsAhead counts those wholly after now. Both
	// are empty on a plain table.
	Partitions      []PartitionStats
	PartitionsAhead int
	// Sources are the busiest sources, by committed keys;
	// OtherSources counts those left out by MaxSources.
	Sources      []SourceStats
	OtherSources int
}

// Stats counts the committed keys by source, completed and unanswered, with
// the oldest and newest key of each, and the claims in flight. Like Check,
// it reads the whole table once, in one read-only snapshot (a partitioned
// table's partitions are then counted once more, one by one).
func Stats(ctx context.Context, db *sql.DB, opts StatsOptions) (*TableStats, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	limit := opts.MaxSources
	switch {
	case limit == 0:
		limit = 100
	case limit < 0:
		return nil, fmt.Errorf("idem: stats: MaxSources %d is negative", limit)
	}
	s := &TableStats{Table: t.Name}
	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		distributed, err := existing(ctx, tx, t)
		if err != nil {
			return err
		}
		// One scan: the busiest sources, and one total row over all of
		// them (total = true, with the number of sources).
		rows, err := tx.QueryContext(ctx, `WITH s AS (
    SELECT source, count(*) FILTER (WHERE completed_at IS NOT NULL) AS done,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until IS NULL) AS open,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until >= now()) AS live,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until < now()) AS expired,
           min(claimed_at) AS oldest, max(claimed_at) AS newest
    FROM `+t.Quoted+` GROUP BY source),
top AS (SELECT * FROM s ORDER BY done + open + live + expired DESC, source LIMIT $1)
SELECT false, source, done, open, live, expired, oldest, newest, 0 FROM top
UNION ALL
SELECT true, '', coalesce(sum(done), 0)::bigint, coalesce(sum(open), 0)::bigint, coalesce(sum(live), 0)::bigint,
       coalesce(sum(expired), 0)::bigint, min(oldest), max(newest), count(*) FROM s`, limit)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				total          bool
				src            SourceStats
				live, expired  int64
				oldest, newest sql.NullTime
				sources        int
			)
			if err := rows.Scan(&total, &src.Source, &src.Completed, &src.Unanswered, &live, &expired, &oldest, &newest, &sources); err != nil {
				return err
			}
			src.Oldest, src.Newest = oldest.Time, newest.Time
			src.Leases = live + expired
			if !total {
				s.Sources = append(s.Sources, src)
				continue
			}
			s.OtherSources = sources
			s.Completed, s.Unanswered, s.LiveLeases, s.ExpiredLeases = src.Completed, src.Unanswered, live, expired
			s.Rows = s.Completed + s.Unanswered + live + expired
			s.Oldest, s.Newest = src.Oldest, src.Newest
		}
		if err := rows.Err(); err != nil {
			return err
		}
		s.OtherSources -= len(s.Sources)
		sort.Slice(s.Sources, func(i, j int) bool {
			a, b := s.Sources[i], s.Sources[j]
			if n, m := a.Completed+a.Unanswered+a.Leases, b.Completed+b.Unanswered+b.Leases; n != m {
				return n > m
			}
			return a.Source < b.Source
		})
		if s.TableBytes, _, err = sizes(ctx, tx, t, distributed); err != nil {
			return err
		}
		if err := s.readPartitions(ctx, tx, t); err != nil {
			return err
		}
		claims, err := inFlightClaims(ctx, tx, t, distributed)
		s.InFlight = len(claims)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: stats %s: %w", t.Name, err)
	}
	return s, nil
}
