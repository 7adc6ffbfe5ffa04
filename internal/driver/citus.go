package driver

import (
	"errors"
	"time"
)

// A table distributed by Citus (docs/citus.md) keeps each key's row in one
// shard, on one worker, whose primary key on (source, event_id) holds the
// key's uniqueness. Advisory locks are per node: a lock taken by a
// statement that reads the table is taken on the worker, one taken by a
// statement that names no table on the node the session is connected to,
// and, with queries from any node (Citus MX), two instances connected to
// two nodes never meet on a lock at all. So a claim there takes no
// advisory lock: the shard's unique index is the arbiter. The claim row is
// inserted first, at the start of the transaction, by a single-shard
// INSERT ... VALUES ... ON CONFLICT DO NOTHING RETURNING, which, when the
// key's row is uncommitted (an original in flight), waits for that
// transaction to end, then inserts nothing (it committed) or inserts (it
// rolled back). lock_timeout, set with SET LOCAL while
// citus.propagate_set_commands is 'local' so that Citus sends it to the
// worker where the wait happens (set_config is not propagated), bounds the
// wait: SQLSTATE 55P03, answered 409, once it runs out. Citus refuses a
// volatile function in an INSERT's DO UPDATE SET and in the WHERE of an
// UPDATE, and plans an INSERT ... SELECT on the coordinator: none is used.

// ErrDistributedPartitioned is a claim's error on a partitioned table
// distributed by Citus: a partition's primary key holds the key's
// uniqueness within that partition only, so a claim there needs the key's
// advisory lock, which instances connected to different nodes do not
// share. idem claims on Citus need a plain table (docs/citus.md).
var ErrDistributedPartitioned = errors.New("idem: the table is partitioned and distributed by Citus: claims on Citus need a plain table, distributed by event_id (docs/citus.md)")

// CitusQueries are the statements of a claim on a table distributed by
// Citus.
type CitusQueries struct {
	// Set begin every claim transaction: lock_timeout for the wait, set
	// so that Citus propagates it. One statement per element where
	// statements are pipelined; joined into one statement of two commands
	// otherwise (a statement without parameters travels in the simple
	// protocol, which runs several commands).
	Set []string
	// Claim inserts the key's claim: a row back means this transaction
	// owns the key. Read reads the key's row (no row: none).
	Claim, Read string
	// ClaimLease is the lease-mode claim: the key inserted in progress,
	// or a key whose lease ran out taken over; no function in DO UPDATE
	// SET, whose values come from VALUES (excluded). The first column is
	// true for a takeover.
	ClaimLease string
	// TakeOver is Queries.TakeOver without the key's lock: the row lock
	// of the UPDATE serialises two takeovers, and the second, after the
	// wait, finds the lease no longer run out.
	TakeOver string
}

// NewCitusQueries builds the statements of a claim on the table quoted,
// distributed by Citus, whose waits for an original in flight last at most
// wait; joined: Set as one statement.
func NewCitusQueries(quoted string, wait time.Duration, joined bool) CitusQueries {
	q := quoted
	set := []string{
		`SET LOCAL citus.propagate_set_commands TO 'local'`,
		`SET LOCAL lock_timeout TO '` + LockTimeout(wait) + `'`,
	}
	if joined {
		set = []string{set[0] + `; ` + set[1]}
	}
	return CitusQueries{
		Set: set,
		Claim: `INSERT INTO ` + q + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING
RETURNING true`,
		Read: `SELECT ` + rowColumns + `
FROM ` + q + ` AS r WHERE r.source = $1 AND r.event_id = $2` + notAhead("r."),
		ClaimLease: `INSERT INTO ` + q + ` AS r (source, event_id, payload_digest, lease_until, lease_token, claimed_at)
VALUES ($1, $2, $3, now() + $4 * interval '1 microsecond', $5, now())
ON CONFLICT (source, event_id) DO UPDATE
SET payload_digest = excluded.payload_digest, lease_until = excluded.lease_until,
    lease_token = excluded.lease_token, claimed_at = excluded.claimed_at
WHERE r.completed_at IS NULL AND r.lease_until < excluded.claimed_at
RETURNING r.xmax <> 0`,
		TakeOver: `UPDATE ` + q + `
SET payload_digest = $3, lease_until = NULL, lease_token = NULL, claimed_at = now()
WHERE source = $1 AND event_id = $2 AND completed_at IS NULL AND lease_until < now()`,
	}
}
