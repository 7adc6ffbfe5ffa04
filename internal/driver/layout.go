package driver

import (
	"context"
	"errors"
	"sync/atomic"
)

// A partitioned table (range-partitioned on claimed_at, see docs/partitioning.md)
// has no primary key on (source, event_id) across partitions: each partition
// has its own. ON CONFLICT sees one partition only, so a claim there must take
// the key's advisory lock first and then look for the key in every partition
// with a new statement, whose snapshot (at READ COMMITTED) comes after the
// lock: the lock-first claim of Queries.TryLock, Read and InsertCompleted.
// An adapter finds out which layout its table has on its first claim (one
// catalog query, remembered), so no option is needed.

// claimOrRead is the claim of database/sql on a partitioned table, in the
// transaction that has just sent TryLock ($4 is what it answered): a new
// statement, so its snapshot comes after the lock. It reads the key's row in
// every partition and, only when there is none and the lock is this
// transaction's, inserts the claim with claimed_at = now() (whatever the
// column's default), which the answer's UPDATE (CompleteClaimedNow) finds in
// the one partition of that time and completes as on a plain table (so a
// handler that commits the transaction itself leaves an unanswered key,
// never a key that runs again). It returns whether it inserted, and the row
// it read, if any: a duplicate costs no further statement.
func claimOrRead(q string) string { return claimOrReadIn(q, q) }

// claimOrReadIn is claimOrRead looking for the key in src (a table, or a
// parenthesized query of its columns) and inserting it into dst.
func claimOrReadIn(src, dst string) string {
	return `WITH ` + keyRow(src) + `,
ins AS (
    INSERT INTO ` + dst + ` (source, event_id, payload_digest, claimed_at)
    SELECT $1, $2, $3, now() WHERE $4::boolean AND NOT EXISTS (SELECT FROM r)
    RETURNING true AS won)
SELECT coalesce((SELECT won FROM ins), false), ` + keyRowColumns
}

// keyRow is the CTE r: the key's row read in every partition (at most
// one), for claimOrRead and claimLeaseOrRead. keyRowColumns select it, as
// the lookups' columns after the first, from a row that is always there.
func keyRow(q string) string {
	return `r AS MATERIALIZED (
    SELECT payload_digest, response_status, response_headers, response_body, completed_at IS NOT NULL AS done,
           ` + leaseColumns("") + `
    FROM ` + q + ` AS k WHERE source = $1 AND event_id = $2` + notAhead("") + ` LIMIT 1)`
}

// keyColumns are the columns a lookup of a key reads from a union of
// partitions (PartitionQueries), named: a partition attached by hand may
// order them otherwise.
const keyColumns = `source, event_id, payload_digest, response_status, response_headers, response_body,
    claimed_at, completed_at, lease_until, lease_token`

// PartitionQueries are the statements of a claim on a partitioned table
// whose key the summaries of the past partitions rule out of all but past
// (summary.Summaries): the plain table's statements on the current partition
// (whose own primary key ON CONFLICT uses), except that the claim first
// looks for the key in past (ClaimPast) and the lookups read past too. The
// partitions in past are closed: every transaction that could write a row
// into them has ended, so what a statement finds there does not depend on
// when its snapshot was taken, and the key's lock need not come first. A
// takeover keeps the table's statement: the row it changes may be in any
// partition.
func PartitionQueries(all Queries, current string, past []string) Queries {
	q := NewQueries(current)
	q.Table, q.TakeOver = all.Table, all.TakeOver
	q.ClaimPast = claimPast(union(past), current)
	in := NewQueries(union(append([]string{current}, past...)))
	q.Read, q.Lookup, q.LookupRestoring = in.Read, in.Lookup, in.LookupRestoring
	return q
}

// union is a parenthesized query of the key columns of the partitions.
func union(partitions []string) string {
	src := `(`
	for i, p := range partitions {
		if i > 0 {
			src += ` UNION ALL `
		}
		src += `SELECT ` + keyColumns + ` FROM ` + p
	}
	return src + `)`
}

// AnsweredIn is the statement of summary.Summaries.Answered: the answer of the
// key's row in the partitions past, if it has one.
func AnsweredIn(past []string) string {
	return `SELECT payload_digest, response_status, response_headers, response_body
FROM ` + union(past) + ` AS k WHERE source = $1 AND event_id = $2 AND completed_at IS NOT NULL LIMIT 1`
}

// claimPast is the claim on the current partition of a key that some past
// partitions may hold (src, a union of them): it reads the key's row there
// and, only when there is none, claims the key in current as the plain
// Claim does (the key's lock without waiting, then ON CONFLICT). It
// returns whether it inserted, the transaction's start (summary.Current.Holds),
// and the row it found in the past, if any: a redelivery of a completed
// key costs no further statement.
func claimPast(src, current string) string {
	return `WITH ` + keyRow(src) + `,
ins AS (
    INSERT INTO ` + current + ` (source, event_id, payload_digest)
    SELECT $1, $2, $3 WHERE NOT EXISTS (SELECT FROM r) AND pg_try_advisory_xact_lock($4)
    ON CONFLICT (source, event_id) DO NOTHING
    RETURNING true AS won)
SELECT coalesce((SELECT won FROM ins), false), now(), ` + keyRowColumns
}

const keyRowColumns = `r.payload_digest, coalesce(r.response_status, 0), r.response_headers, r.response_body, coalesce(r.done, false),
       coalesce(r.leased, false), coalesce(r.lease_left, 0)
FROM (VALUES (1)) AS one LEFT JOIN r ON true`

// notAhead is the condition, on the claimed_at of the table aliased
// prefix, that keeps the partitions made ahead of time out of a lookup of
// a key: PostgreSQL prunes the partitions that begin later when the
// statement starts, so they cost a claim nothing. A committed row's
// claimed_at is the start of its transaction, before its commit, so before
// any statement that can see it; the minute allows for a clock stepped
// back. On a plain table it filters the one row the primary key found.
func notAhead(prefix string) string {
	return " AND " + prefix + "claimed_at < statement_timestamp() + interval '1 minute'"
}

// PartitionBoundsSQL follows pg_inherits i JOIN pg_class c (a partition)
// in a FROM list, for the listings of partitions: b, its bound's text,
// NULL while it is being detached, 'DEFAULT' for a default partition; lo
// and hi, its bounds, NULL for MINVALUE and MAXVALUE. The bound is printed
// in ISO style, whose numeric offsets read back exactly whatever the
// session's TimeZone (other styles print zone abbreviations, some of them
// read back as another zone): DateStyle is set for the statement's
// transaction before the bound is printed.
const PartitionBoundsSQL = `CROSS JOIN LATERAL (SELECT CASE WHEN set_config('DateStyle', 'ISO', true) IS NOT NULL
    THEN pg_get_expr(c.relpartbound, 0) END) AS pb(b) -- 0: no lock on the partition
CROSS JOIN LATERAL (SELECT (regexp_match(pb.b, 'FROM [(]''([^'']*)''[)]'))[1]::timestamptz,
    (regexp_match(pb.b, 'TO [(]''([^'']*)''[)]'))[1]::timestamptz) AS bounds(lo, hi)`

// LayoutSQL reads what a claim needs to know of the table named by $1
// (quoted, as Queries.Table): whether it is partitioned, and whether the
// citus extension is installed in the database (then DistributedSQL says
// whether Citus distributes the table). No row when the table does not
// exist.
const LayoutSQL = `SELECT c.relkind = 'p', EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')
FROM pg_class c WHERE c.oid = to_regclass($1)`

// DistributedSQL reports whether Citus's metadata holds the table named by
// $1: a distributed table (or a reference or Citus local one), which the
// claim of a table distributed by Citus serves (docs/citus.md). Sent only
// where LayoutSQL found the citus extension: pg_dist_partition exists
// only there.
const DistributedSQL = `SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = to_regclass($1))`

// ErrPartitionedIsolation is a claim's error on a partitioned table when the
// claim transaction would not run at READ COMMITTED: at REPEATABLE READ or
// SERIALIZABLE a transaction's snapshot is taken by its first statement,
// before the key's lock is held, so a delivery that committed in between
// would be invisible and its key claimed a second time in another partition.
var ErrPartitionedIsolation = errors.New("idem: the table is partitioned: its claims need READ COMMITTED, and Options.TxOptions asks for a higher isolation level")

// Kind is the layout of a claim's table, as LayoutSQL and DistributedSQL
// read it.
type Kind int32

const (
	// Plain: one table, whose primary key on (source, event_id) ON
	// CONFLICT uses.
	Plain Kind = iota + 1
	// Partitioned: range-partitioned on claimed_at (docs/partitioning.md).
	Partitioned
	// Distributed: a plain table distributed by Citus (docs/citus.md).
	Distributed
	// DistributedPartitioned: a partitioned table distributed by Citus,
	// which claims refuse (ErrDistributedPartitioned).
	DistributedPartitioned
)

// Layout remembers the layout of an adapter's table, once known. The zero
// value knows nothing yet.
type Layout struct {
	state atomic.Int32 // 0 unknown, else a Kind
}

// Kind is the table's layout, asking the database with query on the
// first call, and again after Forget. query returns 0 for a table that
// does not exist, which counts as plain and is asked about again next
// time: the claim fails on it anyway.
func (l *Layout) Kind(ctx context.Context, query func(context.Context) (Kind, error)) (Kind, error) {
	if k := Kind(l.state.Load()); k != 0 {
		return k, nil
	}
	k, err := query(ctx)
	switch {
	case err != nil:
		return 0, err
	case k == 0:
		return Plain, nil
	}
	l.state.Store(int32(k))
	return k, nil
}

// Forget makes the next claim ask again: the plain claim found that the
// table has no unique index on (source, event_id), as happens when it was
// converted to a partitioned one while the application ran.
func (l *Layout) Forget() { l.state.Store(0) }

// NoConflictTarget is the SQLSTATE (invalid_column_reference) of an INSERT
// whose ON CONFLICT names columns without a unique index: the plain claim
// on a partitioned table.
const NoConflictTarget = "42P10"

// claimLeaseOrRead is the lease-mode claim on a partitioned table, sent in
// a transaction after TryLock (locked, $4: its result), as a statement of
// its own whose snapshot comes after the lock: it looks for the key in
// every partition, takes over a row whose lease ran out, or inserts the
// key in progress if no partition holds it; and returns the row it found.
// The first column is NULL when nothing was claimed, false for a new key,
// true for a takeover.
func claimLeaseOrRead(q string) string {
	lease := `now() + $5 * interval '1 microsecond'`
	return `WITH ` + keyRow(q) + `,
upd AS (
    UPDATE ` + q + ` SET payload_digest = $3, lease_until = ` + lease + `, lease_token = $6, claimed_at = now()
    WHERE $4::boolean AND source = $1 AND event_id = $2 AND completed_at IS NULL AND lease_until < now()
    RETURNING true AS took),
ins AS (
    INSERT INTO ` + q + ` (source, event_id, payload_digest, lease_until, lease_token)
    SELECT $1, $2, $3, ` + lease + `, $6 WHERE $4::boolean AND NOT EXISTS (SELECT FROM r)
    RETURNING false AS took)
SELECT coalesce((SELECT took FROM upd), (SELECT took FROM ins)), ` + keyRowColumns
}
