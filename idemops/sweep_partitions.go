package idemops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/driver"
)

// The sweep of a partitioned table: expired keys go with their partitions.

// dropPartition removes a partition: detached CONCURRENTLY (claims go on
// meanwhile; it waits for the transactions that use the table to end),
// counted, and dropped. A detach that an earlier run left pending is
// finished instead. It returns the keys the partition held. An error
// wrapping errDetached means the partition was detached but not dropped.
func dropPartition(ctx context.Context, db *sql.DB, t catalog.Table, p catalog.Partition) (int64, error) {
	detach := `ALTER TABLE ` + t.Quoted + ` DETACH PARTITION ` + p.Quoted + ` CONCURRENTLY`
	if p.Pending {
		detach = `ALTER TABLE ` + t.Quoted + ` DETACH PARTITION ` + p.Quoted + ` FINALIZE`
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
		return res, fmt.Errorf("idem: sweep %s: %w", s.table.Name, err)
	}
	if res.PartitionsCreated, err = catalog.KeepPartitionsAhead(ctx, db, s.table, s.ahead); err != nil {
		return fail(fmt.Errorf("adding partitions ahead: %w", err))
	}
	parts, err := catalog.ListPartitions(ctx, db, s.table)
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
				s.logr().LogAttrs(ctx, slog.LevelInfo, "idem: sweep stops: another sweep is dropping partitions of the table",
					slog.String("table", s.table.Name))
				return res, nil
			}
			return fail(fmt.Errorf("dropping partition %s: %w", p.Quoted, err))
		}
		res.Removed += n
		res.PartitionsDropped++
		s.logr().LogAttrs(ctx, slog.LevelDebug, "idem: sweep dropped a partition",
			slog.String("table", s.table.Name), slog.String("partition", p.Name), slog.Int64("removed", n))
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
func anotherSweep(ctx context.Context, db *sql.DB, t catalog.Table, p catalog.Partition, before []catalog.Partition) (int, error) {
	now, err := catalog.ListPartitions(ctx, db, t)
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
