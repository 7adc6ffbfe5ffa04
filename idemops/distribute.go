package idemops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/pgidem/idem/internal/catalog"
)

// DistributeOptions configures Distribute.
type DistributeOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it. It must exist (idem.Migrate) and be a
	// plain table: claims on Citus refuse a partitioned one.
	Table string

	// ColocateWith names a table already distributed by a text column
	// (the handler's own table, distributed by the event's id), whose
	// shards the idempotency table's follow: a key's row and the rows its
	// handler writes for the same event id are then on one node, and the
	// claim, the handler's writes and the answer commit on that node
	// alone. "" puts the table in Citus's default colocation group for
	// text distribution columns with the same shard count.
	ColocateWith string
}

// DistributeResult is what Distribute did.
type DistributeResult struct {
	// Distributed: the table was distributed by this call; false when it
	// was already distributed by event_id.
	Distributed bool
	// ColocationID is the table's colocation group in Citus's metadata
	// (pg_dist_partition.colocationid).
	ColocationID int64
}

// ErrNoCitus is Distribute's error where the citus extension is not
// installed in the database.
var ErrNoCitus = errors.New("idem: the citus extension is not installed in this database (CREATE EXTENSION citus on the coordinator)")

// Distribute makes Citus distribute the idempotency table by event_id
// (create_distributed_table), colocated with opts.ColocateWith, on the
// coordinator of a Citus cluster (docs/citus.md). The table's rows, if
// any, are copied to the shards. A table already distributed by event_id
// is left as it is, and an error is returned when it is not colocated
// with opts.ColocateWith (Citus's update_distributed_table_colocation
// moves it); one distributed by another column is an error. Middlewares
// find out on their first claim that the table is distributed: restart
// those that ran before.
func Distribute(ctx context.Context, db *sql.DB, opts DistributeOptions) (DistributeResult, error) {
	var res DistributeResult
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return res, err
	}
	colocate := "default"
	if opts.ColocateWith != "" {
		c, err := catalog.ParseTable(opts.ColocateWith)
		if err != nil {
			return res, err
		}
		colocate = c.Quoted
	}
	fail := func(err error) (DistributeResult, error) {
		return res, fmt.Errorf("idem: distribute %s: %w", t.Name, err)
	}
	kind, err := catalog.RelKind(ctx, db, t)
	switch {
	case err != nil:
		return fail(err)
	case kind == 0:
		return fail(errNoTable)
	case kind == 'p':
		return fail(errors.New("the table is partitioned: claims on Citus need a plain table (docs/citus.md)"))
	}
	var citus bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')`).Scan(&citus); err != nil {
		return fail(err)
	}
	if !citus {
		return fail(ErrNoCitus)
	}
	var (
		column sql.NullString
		group  sql.NullInt64
		other  sql.NullInt64
	)
	err = db.QueryRowContext(ctx, `SELECT
    (SELECT column_to_column_name(logicalrelid, partkey) FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)),
    (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)),
    (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass(nullif($2, 'default')))`,
		t.Quoted, colocate).Scan(&column, &group, &other)
	if err != nil {
		return fail(err)
	}
	if colocate != "default" && !other.Valid {
		return fail(fmt.Errorf("%s is not a distributed table: distribute it first (create_distributed_table)", opts.ColocateWith))
	}
	if group.Valid {
		res.ColocationID = group.Int64
		switch {
		case column.String != "event_id":
			return fail(fmt.Errorf("the table is already distributed, by %q: claims on Citus need it distributed by event_id (undistribute_table, then idem migrate -distribute)", column.String))
		case other.Valid && other.Int64 != group.Int64:
			return fail(fmt.Errorf("the table is already distributed, but not colocated with %s (SELECT update_distributed_table_colocation(%s, colocate_with => %s))",
				opts.ColocateWith, quoteLiteral(t.Quoted), quoteLiteral(colocate)))
		}
		return res, nil
	}
	if _, err := db.ExecContext(ctx, `SELECT create_distributed_table($1, 'event_id', colocate_with => $2)`, t.Quoted, colocate); err != nil {
		return fail(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)`, t.Quoted).Scan(&res.ColocationID); err != nil {
		return fail(err)
	}
	res.Distributed = true
	return res, nil
}

// quoteLiteral quotes s as an SQL string literal, for a statement shown to
// an operator.
func quoteLiteral(s string) string {
	out := []byte{'\''}
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			out = append(out, '\'')
		}
		out = append(out, s[i])
	}
	return string(append(out, '\''))
}
