package idem

import (
	"context"
	"database/sql"
	_ "embed" // schema.sql
	"fmt"
	"net/http"
	"strings"
	"text/template"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/migration"
)

// DefaultTable is the table name used when Options.Table (or Migrate's
// table argument) is empty.
const DefaultTable = catalog.DefaultTable

//go:embed schema.sql
var schemaSQL string

var schemaTmpl = template.Must(template.New("schema").Parse(schemaSQL))

// table is a validated, quoted table name.
type table struct{ catalog.Table }

// parseTable validates a table name (catalog.ParseTable).
func parseTable(name string) (table, error) {
	t, err := catalog.ParseTable(name)
	return table{t}, err
}

// Migrate creates the idempotency table and its index if they do not exist.
// table "" means DefaultTable; "schema.name" places it in an existing schema.
// A name that Options.Table would refuse is refused before any SQL runs.
// It is safe to run twice, and from several processes at once: the DDL runs
// in one transaction under a transaction-level advisory lock. On a
// partitioned table it also keeps partitions ready ahead, as MigrateWith
// does.
func Migrate(ctx context.Context, db *sql.DB, table string) error {
	return MigrateWith(ctx, db, MigrateOptions{Table: table})
}

// MigrateWith is Migrate with options: with PartitionInterval set, it
// creates the table partitioned (see MigrateOptions and
// docs/partitioning.md).
func MigrateWith(ctx context.Context, db *sql.DB, opts MigrateOptions) error {
	_, err := migrate(ctx, db, opts)
	return err
}

func init() {
	migration.Run = func(ctx context.Context, db *sql.DB, opts any) (migration.Result, error) {
		return migrate(ctx, db, opts.(MigrateOptions))
	}
}

// migrate is MigrateWith, returning what it did (for the idem command).
func migrate(ctx context.Context, db *sql.DB, opts MigrateOptions) (migration.Result, error) {
	var res migration.Result
	t, err := parseTable(opts.Table)
	if err != nil {
		return res, err
	}
	if err := opts.validate(); err != nil {
		return res, err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", catalog.MigrateLock(t.Table)); err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	kind, partitioned, err := migrateLayout(ctx, tx, t, opts)
	if err != nil {
		return res, fmt.Errorf("idem: migrate %s: %w", t.Name, err)
	}
	res.Created, res.Partitioned = kind == 0, partitioned
	var columns, indexes int
	if !res.Created {
		if columns, indexes, err = shape(ctx, tx, t); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.Name, err)
		}
	}
	var ddl strings.Builder
	if err := schemaTmpl.Execute(&ddl, map[string]any{"Table": t.Quoted, "ClaimedIndex": t.Index, "Partitioned": partitioned}); err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	for _, stmt := range splitStatements(ddl.String()) {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.Name, err)
		}
	}
	if !res.Created {
		after, afterIdx, err := shape(ctx, tx, t)
		if err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.Name, err)
		}
		res.ColumnsAdded, res.IndexesAdded = after-columns, afterIdx-indexes
	}
	if partitioned {
		if res.PartitionsCreated, err = catalog.EnsurePartitions(ctx, tx, t.Table, opts.PartitionInterval, opts.ahead()); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.Name, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	return res, nil
}

// shape counts the columns and the indexes of the table, for what a
// migration added to it.
func shape(ctx context.Context, tx *sql.Tx, t table) (columns, indexes int, err error) {
	err = tx.QueryRowContext(ctx, `SELECT
    (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped),
    (SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1))`, t.Quoted).Scan(&columns, &indexes)
	return columns, indexes, err
}

// splitStatements splits the schema file on semicolons at line ends and
// drops comment-only pieces. The schema has no semicolons inside literals.
func splitStatements(s string) []string {
	var out []string
	for _, piece := range strings.SplitAfter(s, ";\n") {
		var b strings.Builder
		for _, line := range strings.Split(piece, "\n") {
			if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "--") {
				b.WriteString(line)
				b.WriteByte('\n')
			}
		}
		if stmt := strings.TrimSpace(b.String()); stmt != "" {
			out = append(out, strings.TrimSuffix(stmt, ";"))
		}
	}
	return out
}

// lockID is the advisory lock key of k's claims in this table.
func (t table) lockID(k Key) int64 { return catalog.LockID(t.Rel, k.Source, k.EventID) }

// stored is a completed answer: what the first delivery was told.
type stored struct {
	digest []byte
	status int
	header http.Header
	body   []byte
}
