package idem

import (
	"context"
	"database/sql"
	_ "embed" // schema.sql
	"fmt"
	"net/http"
	"strings"
	"text/template"

	"github.com/pgidem/idem/internal/migration"
)

// DefaultTable is the table name used when Options.Table (or Migrate's
// table argument) is empty.
const DefaultTable = "webhook_idempotency"

//go:embed schema.sql
var schemaSQL string

var schemaTmpl = template.Must(template.New("schema").Parse(schemaSQL))

// table is a validated, quoted table name.
type table struct {
	name   string // as given, or DefaultTable
	quoted string // "schema"."name" or "name"
	index  string // the quoted name of the claimed_at index
	schema string // the unquoted schema, "" when unqualified
	rel    string // the unquoted table name without schema
}

// parseTable validates a table name: "name" or "schema.name", each part a
// lower-case SQL identifier (validIdent). Anything else is refused before
// any SQL runs. The parts are quoted all the same, so that a name that is
// also a keyword ("order", "user") works.
func parseTable(name string) (table, error) {
	if name == "" {
		name = DefaultTable
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return table{}, fmt.Errorf("idem: table %q: at most one dot, between schema and table", name)
	}
	for _, p := range parts {
		if !validIdent(p) {
			return table{}, fmt.Errorf("idem: table %q: %s", name, identRule)
		}
	}
	t := table{name: name, rel: parts[len(parts)-1]}
	t.index = quoteIdent(indexName(t.rel))
	if len(parts) == 2 {
		t.schema = parts[0]
		t.quoted = quoteIdent(parts[0]) + "." + quoteIdent(parts[1])
	} else {
		t.quoted = quoteIdent(parts[0])
	}
	return t, nil
}

// identRule says what validIdent accepts, for its errors.
const identRule = "the table and its schema must each be 1 to 63 characters of a-z, 0-9 and _, not starting with a digit"

// validIdent reports whether s is a part of a table name idem accepts:
// [a-z_][a-z0-9_]{0,62}. That is a name PostgreSQL reads the same quoted or
// not (unquoted identifiers fold to lower case), so the table idem uses is
// the one an operator's unquoted SQL names; it fits PostgreSQL's 63-byte
// identifiers without being cut; and it leaves out what would need quoting
// in every query of the operator's own (upper case, spaces, quotes, $,
// non-ASCII letters).
func validIdent(s string) bool {
	if len(s) == 0 || len(s) > 63 || ('0' <= s[0] && s[0] <= '9') {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// indexName is "<table>_claimed_idx", or, when that would not fit in
// PostgreSQL's 63-byte identifiers, a prefix of the table name with a hash
// of the whole: a name cut to 63 bytes could be the table's own name (and
// CREATE INDEX IF NOT EXISTS would quietly skip), or another long table's
// index name.
func indexName(rel string) string {
	const suffix = "_claimed_idx"
	if len(rel)+len(suffix) <= 63 {
		return rel + suffix
	}
	h := uint32(lockID(rel, "", "")) // any stable hash of the full name
	return fmt.Sprintf("%s_%08x%s", rel[:63-len(suffix)-9], h, suffix)
}

// quoteIdent quotes a PostgreSQL identifier: wrapped in double quotes, with
// inner double quotes doubled.
func quoteIdent(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
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
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLock(t)); err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	kind, partitioned, err := migrateLayout(ctx, tx, t, opts)
	if err != nil {
		return res, fmt.Errorf("idem: migrate %s: %w", t.name, err)
	}
	res.Created, res.Partitioned = kind == 0, partitioned
	var columns, indexes int
	if !res.Created {
		if columns, indexes, err = shape(ctx, tx, t); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.name, err)
		}
	}
	var ddl strings.Builder
	if err := schemaTmpl.Execute(&ddl, map[string]any{"Table": t.quoted, "ClaimedIndex": t.index, "Partitioned": partitioned}); err != nil {
		return res, fmt.Errorf("idem: migrate: %w", err)
	}
	for _, stmt := range splitStatements(ddl.String()) {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.name, err)
		}
	}
	if !res.Created {
		after, afterIdx, err := shape(ctx, tx, t)
		if err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.name, err)
		}
		res.ColumnsAdded, res.IndexesAdded = after-columns, afterIdx-indexes
	}
	if partitioned {
		if res.PartitionsCreated, err = ensurePartitions(ctx, tx, t, opts.PartitionInterval, opts.ahead()); err != nil {
			return res, fmt.Errorf("idem: migrate %s: %w", t.name, err)
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
    (SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1))`, t.quoted).Scan(&columns, &indexes)
	return columns, indexes, err
}

// migrateLock is the advisory lock under which Migrate changes the table
// (and the sweep adds partitions).
func migrateLock(t table) int64 { return lockID("idem-migrate", t.name, "") }

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

// lockID is the 64-bit advisory lock key of a claim: FNV-1a over the table
// name, the source and the event id, separated by NUL (which none of them may
// contain). The table enters without its schema, so every spelling of one
// table ("webhook_idempotency", "public.webhook_idempotency") agrees on the
// lock; same-named tables in two schemas merely share a lock space. Distinct
// keys can share a lock only by such sharing or a 64-bit hash collision,
// which at worst makes a delivery wait or answer 409 once.
func lockID(tableName, source, eventID string) int64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for _, s := range [...]string{tableName, source, eventID} {
		for i := 0; i < len(s); i++ {
			h ^= uint64(s[i])
			h *= prime
		}
		h *= prime // the NUL separator
	}
	return int64(h)
}

// lockID is the advisory lock key of k's claims in this table.
func (t table) lockID(k Key) int64 { return lockID(t.rel, k.Source, k.EventID) }

// stored is a completed answer: what the first delivery was told.
type stored struct {
	digest []byte
	status int
	header http.Header
	body   []byte
}
