package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/driver"
)

// Partitioned tables (docs/partitioning.md): how MigrateWith creates one.
// The partitions themselves are read and created by internal/catalog, and
// dropped by the sweep of package idemops.

// Partitioning defaults and bounds.
const (
	// DefaultPartitionsAhead is how many partitions after the current one
	// Migrate and Sweep keep ready when MigrateOptions.PartitionsAhead (or
	// idemops.SweepOptions.PartitionsAhead) is 0.
	DefaultPartitionsAhead = 3

	// MinPartitionInterval is the shortest partition interval: a claim
	// must be able to rule its key out of every past partition, so
	// partitions must stay few.
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
// before the snapshot that looks for the key in the partitions is taken,
// which only READ COMMITTED allows (docs/partitioning.md).
var ErrPartitionedIsolation = driver.ErrPartitionedIsolation

// errNotPartitioned: MigrateWith was asked for partitions on a plain table.
var errNotPartitioned = errors.New("the table exists and is not partitioned: convert it by hand (docs/partitioning.md), or migrate without a partition interval")

// migrateLayout decides whether Migrate works on a partitioned table: one
// that is, or a missing one with a partition interval. kind is the table's
// catalog.RelKind, 0 when it does not exist yet.
func migrateLayout(ctx context.Context, tx *sql.Tx, t table, opts MigrateOptions) (kind byte, partitioned bool, err error) {
	kind, err = catalog.RelKind(ctx, tx, t.Table)
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
