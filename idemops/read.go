package idemops

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"time"

	"github.com/pgidem/idem/internal/catalog"
)

// What Check and Stats read alike: one read-only snapshot, the table's
// existence, and the claims in flight.

// readOnly runs f in a read-only REPEATABLE READ transaction: one snapshot
// and one now() for every query of a report.
func readOnly(ctx context.Context, db *sql.DB, f func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// errNoTable is returned when the table does not exist.
var errNoTable = errors.New("the table does not exist (run idem.Migrate, or the idem migrate command)")

func tableExists(ctx context.Context, tx *sql.Tx, t catalog.Table) error {
	var ok bool
	if err := tx.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.Quoted).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return errNoTable
	}
	return nil
}

// existing returns errNoTable when the table does not exist, and whether
// Citus distributes it.
func existing(ctx context.Context, tx *sql.Tx, t catalog.Table) (distributed bool, err error) {
	if err := tableExists(ctx, tx, t); err != nil {
		return false, err
	}
	return catalog.Distributed(ctx, tx, t)
}

// sizes reads the table's size on disk, indexes and TOAST included, and
// how many rows were deleted from it since the statistics were last
// reset: of the table and its partitions, or, for a table distributed by
// Citus, of its shards on every node (citus_total_relation_size, and
// run_command_on_shards for the counter).
func sizes(ctx context.Context, tx *sql.Tx, t catalog.Table, distributed bool) (bytes, deleted int64, err error) {
	q := `SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint,
       coalesce(sum(pg_stat_get_tuples_deleted(relid)), 0)::bigint FROM ` + treeSQL("$1")
	if distributed {
		q = `SELECT citus_total_relation_size(to_regclass($1)),
       (SELECT coalesce(sum(result::bigint), 0)::bigint
        FROM run_command_on_shards(to_regclass($1), $$SELECT pg_stat_get_tuples_deleted('%s'::regclass)$$) WHERE success)`
	}
	err = tx.QueryRowContext(ctx, q, t.Quoted).Scan(&bytes, &deleted)
	return bytes, deleted, err
}

// listKeys lists the oldest keys without an answer that match cond.
func listKeys(ctx context.Context, tx *sql.Tx, t catalog.Table, cond string) ([]UnansweredKey, error) {
	rows, err := tx.QueryContext(ctx, `SELECT source, event_id, claimed_at FROM `+t.Quoted+`
WHERE completed_at IS NULL AND `+cond+` ORDER BY claimed_at LIMIT `+strconv.Itoa(maxListed))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []UnansweredKey
	for rows.Next() {
		var k UnansweredKey
		if err := rows.Scan(&k.Key.Source, &k.Key.EventID, &k.ClaimedAt); err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, rows.Err()
}

// inFlightClaims lists the open claim transactions on the table, oldest
// first. A claim in flight is an uncommitted insert, invisible to every
// other session, and holds a transaction-level advisory lock on its key
// until it ends: so a claim is a session of this database that holds a
// granted advisory lock on a bigint key and a lock on the table (taken by
// its INSERT, or by the read of a claim that inserts its row at the end, as
// idempgx does), the locks every claim transaction holds to its end. A
// duplicate in the few milliseconds between taking the lock and rolling
// back matches too; a sweep (no advisory lock) or a session waiting for a
// lock it does not hold does not.
//
// On a table distributed by Citus a claim takes no advisory lock: a claim
// is then a session holding a RowExclusiveLock on the table, as its INSERT
// takes, among the sessions of the node checked (the coordinator's, not
// those of instances connected to workers).
func inFlightClaims(ctx context.Context, tx *sql.Tx, t catalog.Table, distributed bool) ([]InFlightClaim, error) {
	claimLock := `l.locktype = 'advisory' AND l.objsubid = 1`
	if distributed {
		claimLock = `l.locktype = 'relation' AND l.mode = 'RowExclusiveLock' AND l.relation = to_regclass($1)`
	}
	rows, err := tx.QueryContext(ctx, `WITH d AS (SELECT oid FROM pg_database WHERE datname = current_database())
SELECT a.pid, a.xact_start, coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8,
       coalesce(a.state, ''), coalesce(a.wait_event_type || ':' || a.wait_event, ''),
       coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), coalesce(left(a.query, 200), '')
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
  AND EXISTS (SELECT 1 FROM pg_locks l, d WHERE l.pid = a.pid AND l.granted AND l.database = d.oid
              AND l.locktype = 'relation' AND (l.relation = to_regclass($1)
                   OR l.relation IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1))))
  AND EXISTS (SELECT 1 FROM pg_locks l, d WHERE l.pid = a.pid AND l.granted AND l.database = d.oid
              AND `+claimLock+`)
ORDER BY a.xact_start NULLS FIRST, a.pid`, t.Quoted)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []InFlightClaim
	for rows.Next() {
		var (
			c     InFlightClaim
			start sql.NullTime
			age   float64
		)
		if err := rows.Scan(&c.PID, &start, &age, &c.State, &c.WaitEvent, &c.Application, &c.Client, &c.Query); err != nil {
			return nil, err
		}
		if start.Valid {
			c.XactStart = start.Time
			c.Age = time.Duration(age * float64(time.Second))
		}
		out = append(out, c)
	}
	return out, rows.Err()
}
