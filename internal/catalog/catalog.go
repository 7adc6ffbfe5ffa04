// Package catalog is what package idem and package idemops both know about
// the idempotency table: its name, validated and quoted; the advisory lock
// keys derived from it; and, on a partitioned table, its partitions, read
// from PostgreSQL's catalog and created ahead. Nothing here is public API:
// Go's internal rule keeps it to this module.
package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/pgidem/idem/internal/driver"
)

// DefaultTable is the table name used when none is given.
const DefaultTable = "webhook_idempotency"

// Table is a validated, quoted table name.
type Table struct {
	Name   string // as given, or DefaultTable
	Quoted string // "schema"."name" or "name"
	Index  string // the quoted name of the claimed_at index
	Schema string // the unquoted schema, "" when unqualified
	Rel    string // the unquoted table name without schema
}

// ParseTable validates a table name: "name" or "schema.name", each part a
// lower-case SQL identifier (validIdent). Anything else is refused before
// any SQL runs. The parts are quoted all the same, so that a name that is
// also a keyword ("order", "user") works.
func ParseTable(name string) (Table, error) {
	if name == "" {
		name = DefaultTable
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("idem: table %q: at most one dot, between schema and table", name)
	}
	for _, p := range parts {
		if !validIdent(p) {
			return Table{}, fmt.Errorf("idem: table %q: %s", name, identRule)
		}
	}
	t := Table{Name: name, Rel: parts[len(parts)-1]}
	t.Index = QuoteIdent(indexName(t.Rel))
	if len(parts) == 2 {
		t.Schema = parts[0]
		t.Quoted = QuoteIdent(parts[0]) + "." + QuoteIdent(parts[1])
	} else {
		t.Quoted = QuoteIdent(parts[0])
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
	return fitName(rel, "_claimed_idx")
}

// fitName is rel+suffix, or, when that would not fit in 63 bytes, a prefix
// of rel with a hash of the whole before suffix.
func fitName(rel, suffix string) string {
	if len(rel)+len(suffix) <= 63 {
		return rel + suffix
	}
	h := uint32(LockID(rel, "", "")) // any stable hash of the full name
	return fmt.Sprintf("%s_%08x%s", rel[:63-len(suffix)-9], h, suffix)
}

// QuoteIdent quotes a PostgreSQL identifier: wrapped in double quotes, with
// inner double quotes doubled.
func QuoteIdent(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// LockID is the 64-bit advisory lock key of a claim: FNV-1a over the table
// name, the source and the event id, separated by NUL (which none of them may
// contain). The table enters without its schema, so every spelling of one
// table ("webhook_idempotency", "public.webhook_idempotency") agrees on the
// lock; same-named tables in two schemas merely share a lock space. Distinct
// keys can share a lock only by such sharing or a 64-bit hash collision,
// which at worst makes a delivery wait or answer 409 once.
func LockID(tableName, source, eventID string) int64 {
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

// MigrateLock is the advisory lock under which Migrate changes the table
// (and the sweep adds partitions).
func MigrateLock(t Table) int64 { return LockID("idem-migrate", t.Name, "") }

// Queryer is a *sql.DB or a *sql.Tx.
type Queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// RelKind returns the table's pg_class.relkind: 'r' plain, 'p'
// partitioned, 0 when it does not exist.
func RelKind(ctx context.Context, q Queryer, t Table) (byte, error) {
	var kind sql.NullString
	err := q.QueryRowContext(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, t.Quoted).Scan(&kind)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && kind.String == "") {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return kind.String[0], nil
}

// Distributed reports whether Citus distributes the table: the citus
// extension is installed and its metadata (pg_dist_partition, which exists
// only then) holds the table (docs/citus.md).
func Distributed(ctx context.Context, q Queryer, t Table) (bool, error) {
	var citus bool
	err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')`).Scan(&citus)
	if err != nil || !citus {
		return false, err
	}
	var dist bool
	err = q.QueryRowContext(ctx, driver.DistributedSQL, t.Quoted).Scan(&dist)
	return dist, err
}
