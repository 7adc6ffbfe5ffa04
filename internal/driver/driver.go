// Package driver is the seam between idem's engine (package idem: the claim,
// the wait, the replay, the behaviour of every answer) and the database.
// The engine sees Driver and Tx: whole operations ("begin and claim",
// "store the answer and commit"), implemented once, in package claims, with
// the SQL of Queries. An adapter (database/sql in package idem, pgx in
// package idempgx) implements only Pool and Conn (conn.go): how statements
// travel, one round trip each on database/sql, pipelined on pgx. The
// engine cannot tell which ran.
//
// Nothing here is public API: Go's internal rule keeps it to this module.
package driver

import (
	"context"
	"database/sql"
	sqldriver "database/sql/driver"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// Args names one key's claim: its source and event id, the SHA-256 of the
// request body, and the key's advisory lock.
type Args struct {
	Source, EventID string
	Digest          []byte
	Lock            int64
}

// State is what a lookup found for a key: whether a row is there, what it
// holds, and, where that decides, whether the key's lock is this
// transaction's. It is computed in one place (Scan.Row), from the columns
// every statement that reads a key's row returns.
type State uint8

const (
	// Free: no row, and the key's lock is this transaction's: claim it.
	Free State = iota
	// InFlight: no row this transaction can see, and another transaction
	// holds the key's lock: a claim in flight.
	InFlight
	// Completed: the row holds an answer.
	Completed
	// Unanswered: the row was committed without an answer (a handler that
	// ended the middleware's transaction itself).
	Unanswered
	// LeaseLive: a lease-mode row in progress whose lease still runs.
	LeaseLive
	// LeaseExpired: a lease-mode row in progress whose lease ran out, and
	// the key's lock is this transaction's: it may take the key over.
	LeaseExpired
	// TakingOver: a lease-mode row whose lease ran out while another
	// transaction holds the key's lock: another claim is taking it over.
	TakingOver
)

// Row is what a lookup read: the key's State and, when a row was read, what
// it holds.
type Row struct {
	State   State
	Digest  []byte // the request body's SHA-256 the row was claimed with
	Status  int
	Headers []byte // the stored headers' JSON
	Body    []byte
	// LeaseLeft is how long the row's lease still runs, by the database's
	// clock when the statement ran: positive while it runs, zero or
	// negative once it has run out, zero without a lease.
	LeaseLeft time.Duration
}

// Scan receives the columns of a key's row as every statement that reads
// one returns them, in this order: payload_digest, response_status (0
// without an answer), response_headers, response_body, whether the row is
// completed, whether it is a lease-mode row in progress, and the lease's
// time left in nanoseconds (rowColumns, keyRowColumns). Every statement's
// row is read through Columns or Lookup, and becomes a State in Row: the
// one place that happens.
type Scan struct {
	// Locked is whether the key's lock is this transaction's: the first
	// column of a lookup, or TryLock's answer.
	Locked       bool
	row          Row
	status       int64
	done, leased bool
}

// Columns are the destinations of lead, then of the row's columns.
func (s *Scan) Columns(lead ...any) []any {
	return append(lead, &s.row.Digest, &s.status, &s.row.Headers, &s.row.Body, &s.done, &s.leased, &s.row.LeaseLeft)
}

// Lookup are the destinations of a lookup's columns (Queries.Lookup,
// LookupRestoring): the key's lock, the row's, then trail.
func (s *Scan) Lookup(trail ...any) []any {
	return append(s.Columns(&s.Locked), trail...)
}

// Row is the row scanned, with its State. A key without a row reads as a
// NULL payload_digest (or no row at all: Scan untouched).
func (s *Scan) Row() Row {
	r := s.row
	r.Status = int(s.status)
	switch {
	case r.Digest == nil && s.Locked:
		r.State = Free
	case r.Digest == nil:
		r.State = InFlight
	case s.done:
		r.State = Completed
	case s.leased && r.LeaseLeft > 0:
		r.State = LeaseLive
	case s.leased && s.Locked:
		r.State = LeaseExpired
	case s.leased:
		r.State = TakingOver
	default:
		r.State = Unanswered
	}
	return r
}

// Lease is what a lease-mode claim found: Won with the claim's fencing
// Token (TookOver when it took over a key whose lease had run out);
// otherwise Row, read by a statement after the claim's.
type Lease struct {
	Won, TookOver bool
	Token         int64
	Row           Row
}

// LeaseTx is the transaction a lease-mode handler writes through, begun
// when it first asks for it.
type LeaseTx interface {
	// Complete stores the answer, only if token still owns the key, and
	// commits; ErrFenced when it does not. An error means nothing was
	// committed; the caller then calls Rollback.
	Complete(ctx context.Context, a *Args, token int64, status int, headers, body []byte) error
	Rollback(ctx context.Context) error
	Handle() any
}

// ErrFenced is the error of a lease-mode completion whose token no longer
// owns the key: its lease ran out and another delivery took the key over.
var ErrFenced = errors.New("the key's lease ran out and another delivery took it over")

// Begun is what Driver.Begin did: Won when the claim inserted the key;
// otherwise Row, read by a statement after the claim's. Tx is the claim's
// transaction, open, unless Answered: the key's answer (Row, Completed) was
// read without a transaction (summary.Summaries.Answered), and Tx is nil.
type Begun struct {
	Tx       Tx
	Won      bool
	Answered bool
	Row      Row
}

// Driver begins claims on one database and table.
type Driver interface {
	// Begin begins a transaction, claims the key in it and, when the claim
	// inserted nothing, reads the key's row and lock with a new statement.
	// On error no transaction is left open.
	Begin(ctx context.Context, a *Args) (Begun, error)
	// PoolCap is the connection pool's cap, 0 for none.
	PoolCap() int

	// ClaimLease claims the key in lease mode, in a statement that commits
	// on its own: as in progress, until now + lease, with token; or takes
	// over a key whose lease has run out. It waits at most wait for a lock
	// on the key's row (a completion committing): SQLSTATE 55P03 after
	// that. When it claims nothing, a second statement reads the key's row
	// and lock.
	ClaimLease(ctx context.Context, a *Args, lease, wait time.Duration, token int64) (Lease, error)
	// BeginLease begins the transaction of a lease-mode handler.
	BeginLease(ctx context.Context) (LeaseTx, error)
	// CompleteLease stores the answer of a lease-mode handler that wrote
	// nothing, in a statement that commits on its own, only if token still
	// owns the key; ErrFenced when it does not.
	CompleteLease(ctx context.Context, a *Args, token int64, status int, headers, body []byte) error
	// ExtendLease makes the lease that token owns run for lease from now,
	// in a statement that commits on its own; ErrFenced when token no
	// longer owns the key.
	ExtendLease(ctx context.Context, a *Args, token int64, lease time.Duration) error
	// EndLease ends the lease that token owns on a key not completed: it
	// deletes the in-progress row, so that the next delivery runs at once;
	// or, with keep, turns it into a claim committed without an answer,
	// which no delivery runs again (the handler ended its transaction
	// itself, and its writes may have committed).
	EndLease(ctx context.Context, a *Args, token int64, keep bool) error
}

// Tx is a claim's transaction.
type Tx interface {
	// Claim claims the key in this transaction, which holds its lock.
	Claim(ctx context.Context, a *Args) (bool, error)
	// TakeOver claims, in this transaction, a key whose lease-mode row has
	// a lease that ran out. False when the row changed meanwhile.
	TakeOver(ctx context.Context, a *Args) (bool, error)
	// Wait waits at most d for the key's lock, with lock_timeout set for
	// this transaction meanwhile (SQLSTATE 55P03 when d runs out), then
	// reads the key's row and lock with a new statement, whose snapshot
	// comes after the wait, and gives the transaction back the
	// lock_timeout it had before (Queries.Wait, LookupRestoring).
	Wait(ctx context.Context, a *Args, d time.Duration) (Row, error)
	// Commit stores the answer in the key's row and commits. An error means
	// nothing was committed; the caller then calls Rollback.
	Commit(ctx context.Context, a *Args, status int, headers, body []byte) error
	// Rollback ends the transaction, if it is still open, and gives the
	// connection back. It is safe to call more than once. Its error wraps
	// ErrConnLost when the connection was lost with the transaction open.
	Rollback(ctx context.Context) error
	// Handle is what the handler gets from the request's context: a *sql.Tx
	// or a pgx.Tx.
	Handle() any
}

// ErrTxDone wraps the error of Commit when the handler itself ended the
// transaction (or tried to): the middleware's misuse answer.
var ErrTxDone = errors.New("the handler ended the middleware's transaction")

// ErrTxEnded wraps ErrTxDone when the handler really ended the transaction
// (COMMIT or ROLLBACK of its own, not a call the adapter refused): its
// writes may have committed, so the key must not run again.
var ErrTxEnded = errors.New("the transaction was ended by the handler; its writes may have committed")

// ErrConnLost wraps the error of a rollback whose connection was lost with
// the transaction open (a failover, a terminated backend, a broken socket):
// the server rolled it back, if it lives, and the handler's answer is most
// likely about that, so the engine answers a store failure instead. A
// rollback refused on a live connection (pgx's "conn busy", when the
// handler left rows open) does not wrap it: the handler's answer stands.
// Adapters wrap it in Conn.Close, for the errors ConnLost recognises.
var ErrConnLost = errors.New("idem: the connection was lost with the transaction open")

// ConnLost reports whether err, a failed ROLLBACK's, says that the
// connection is gone: database/sql's bad or done connection, the socket
// closed or broken, a ROLLBACK the server did not answer in time, the
// server ending the session (SQLSTATE class 08, or 57P01-57P03: a
// terminated backend, a shutdown), or pgx's pgconn.ErrConnClosed (matched
// by its text, as this module's root imports only the standard library).
func ConnLost(err error) bool {
	var ne net.Error
	switch code := SQLState(err); {
	case err == nil:
		return false
	case errors.Is(err, sqldriver.ErrBadConn), errors.Is(err, sql.ErrConnDone),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne):
		return true
	case strings.HasPrefix(code, "08"), code == "57P01", code == "57P02", code == "57P03":
		return true
	}
	return inChain(err, func(e error) bool { return e.Error() == "conn closed" })
}

// inChain reports whether f holds for err or an error it wraps.
func inChain(err error, f func(error) bool) bool {
	if err == nil {
		return false
	}
	if f(err) {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return inChain(u.Unwrap(), f)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if inChain(e, f) {
				return true
			}
		}
	}
	return false
}

// ErrNotStored is Commit's error when the answer's UPDATE found no claim to
// complete: the handler deleted or completed the key's row itself.
var ErrNotStored = errors.New("idem: storing the response found no claim to complete")

// SQLState returns the SQLSTATE code of a PostgreSQL error, or "": pgx's
// *pgconn.PgError and any driver error with the same method. The one place
// an error's code is read, for the engine and both adapters.
func SQLState(err error) string {
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return pe.SQLState()
	}
	return ""
}

// LockTimeout is the lock_timeout setting for a wait of d: whole
// milliseconds, at least 1 (0 would mean "wait forever").
func LockTimeout(d time.Duration) string {
	return strconv.FormatInt(max(1, d.Milliseconds()), 10) + "ms"
}

// Queries are the statements of the claim, for one quoted table name.
type Queries struct {
	Claim, Lookup, LookupRestoring, Wait, Complete string
	// TryLock, Read and InsertCompleted are the lock-first claim: take the
	// key's lock without waiting, read its row with a new statement (whose
	// snapshot comes after the lock), and at the end insert the completed
	// row, one row write instead of the claim's INSERT and UPDATE.
	TryLock, Read, InsertCompleted string
	// InsertUnanswered records a key won lock-first whose handler ended the
	// transaction itself (its writes may have committed) as claimed
	// without an answer, in a statement that commits on its own: as the
	// insert-first claim leaves it, so that no redelivery runs it again.
	InsertUnanswered string
	// CompleteOrFail is Complete that fails (division by zero) when it
	// finds no claim to complete, for a COMMIT pipelined behind it.
	CompleteOrFail string
	// Lease mode: the claim, the fenced completion (and its failing form,
	// for a pipelined COMMIT), the two ends of a lease (EndLease); TakeOver is the
	// single-transaction claim of a key whose lease ran out.
	ClaimLease, CompleteLease, CompleteLeaseOrFail, ReleaseLease, KeepClaim, TakeOver string
	// ExtendLease moves the end of the lease that a token owns to now +
	// the lease ($4, microseconds), in a statement that commits on its
	// own; it changes no row once another delivery took the key over.
	ExtendLease string
	// Table is the quoted table name, the argument of LayoutSQL.
	// ClaimOrRead is the database/sql claim on a partitioned table, sent
	// after TryLock, and CompleteClaimedNow its Complete: layout.go.
	Table, ClaimOrRead, CompleteClaimedNow string
	// ClaimLeaseOrRead is the lease-mode claim on a partitioned table,
	// sent after TryLock: layout.go.
	ClaimLeaseOrRead string
	// ClaimPast, set by PartitionQueries only, claims on the current
	// partition a key that some closed past partitions may hold, after
	// looking for it there, in one statement: layout.go.
	ClaimPast string
}

// EndLease is the statement of Driver.EndLease: KeepClaim with keep, else
// ReleaseLease.
func (q *Queries) EndLease(keep bool) string {
	if keep {
		return q.KeepClaim
	}
	return q.ReleaseLease
}

// leaseColumns read a row's lease state, for Scan (State and LeaseLeft):
// an in-progress row of lease mode, and how long its lease still runs, in
// nanoseconds (0 without a lease). The time left is positive exactly when
// lease_until > now(), since both have whole microseconds. Without a
// prefix (keyRow's CTE) they are named leased and lease_left.
func leaseColumns(prefix string) string {
	left := `coalesce((extract(epoch FROM ` + prefix + `lease_until - now()) * 1000000000)::bigint, 0)`
	if prefix == "" {
		return `lease_until IS NOT NULL AND completed_at IS NULL AS leased, ` + left + ` AS lease_left`
	}
	return prefix + `lease_until IS NOT NULL AND ` + prefix + `completed_at IS NULL, ` + left
}

// rowColumns are Scan's columns, read from the row aliased r: a key
// without a row reads as a NULL payload_digest.
var rowColumns = `r.payload_digest, coalesce(r.response_status, 0), r.response_headers, r.response_body,
       r.completed_at IS NOT NULL, ` + leaseColumns("r.")

// NewQueries builds the statements for the table quoted (already quoted:
// "schema"."name" or "name").
func NewQueries(quoted string) Queries {
	q := quoted
	// The fenced completion of lease mode: only the token that owns the
	// key stores its answer.
	completeLease := `UPDATE ` + q + `
SET response_status = $3, response_headers = $4, response_body = $5, completed_at = now(), lease_until = NULL
WHERE source = $1 AND event_id = $2 AND lease_token = $6 AND completed_at IS NULL`
	complete := `UPDATE ` + q + `
SET response_status = $3, response_headers = $4, response_body = $5, completed_at = now()
WHERE source = $1 AND event_id = $2 AND completed_at IS NULL`
	return Queries{
		Table:       q,
		ClaimOrRead: claimOrRead(q),
		// The row this transaction claimed has claimed_at = now(), the
		// transaction's start (claimOrRead and TakeOver set it so): on a
		// partitioned table PostgreSQL then updates that one partition
		// instead of looking for the key in each.
		CompleteClaimedNow: complete + ` AND claimed_at = now()`,
		ClaimLeaseOrRead:   claimLeaseOrRead(q),
		// The claim decides in one statement: the INSERT runs only if the
		// key's advisory lock is free, taken without waiting. A claim in
		// flight holds that lock until its transaction ends, so a duplicate
		// learns "in flight" at once instead of blocking on the uncommitted
		// row; with the lock, ON CONFLICT decides (the primary key is the
		// lock that counts). A row back means this transaction owns the key.
		// A plain INSERT ... SELECT: a data-modifying CTE that also returned
		// the existing row measured 5-10 % slower for every new event.
		Claim: `INSERT INTO ` + q + ` (source, event_id, payload_digest)
SELECT $1, $2, $3 WHERE pg_try_advisory_xact_lock($4)
ON CONFLICT (source, event_id) DO NOTHING
RETURNING true`,

		// When the claim inserted nothing: the key's row, and whether its
		// lock is free (or already ours). A new statement takes a new
		// snapshot (at READ COMMITTED), so it sees a row that committed
		// while the claim ran or waited.
		Lookup: `SELECT pg_try_advisory_xact_lock($3), ` + rowColumns + `
FROM (VALUES (1)) AS one
LEFT JOIN ` + q + ` AS r ON r.source = $1 AND r.event_id = $2` + notAhead("r."),

		// The lookup after a wait, which gives the transaction back the
		// lock_timeout it had before: the claim may go on to run the
		// handler in this transaction.
		LookupRestoring: `SELECT pg_try_advisory_xact_lock($3), ` + rowColumns + `,
       set_config('lock_timeout', $4, true)
FROM (VALUES (1)) AS one
LEFT JOIN ` + q + ` AS r ON r.source = $1 AND r.event_id = $2` + notAhead("r."),

		// Wait for the claim in flight to end, at most lock_timeout: it is
		// set for this transaction only, before the lock is requested, and
		// its value before is returned, for LookupRestoring.
		Wait: `WITH o AS MATERIALIZED (SELECT current_setting('lock_timeout') AS old),
     s AS MATERIALIZED (SELECT o.old, set_config('lock_timeout', $2, true) FROM o)
SELECT s.old, pg_advisory_xact_lock($1)::text FROM s`,

		// completed_at IS NULL: a second completion changes nothing.
		Complete: complete,

		TryLock: `SELECT pg_try_advisory_xact_lock($1)`,
		Read: `SELECT ` + rowColumns + `
FROM ` + q + ` AS r WHERE r.source = $1 AND r.event_id = $2` + notAhead("r."),
		InsertCompleted: `INSERT INTO ` + q + ` (source, event_id, payload_digest, response_status, response_headers, response_body, completed_at)
VALUES ($1, $2, $3, $4, $5, $6, now())`,
		InsertUnanswered: `INSERT INTO ` + q + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)`,

		CompleteOrFail: `WITH u AS (` + complete + `
RETURNING 1)
SELECT 1 / (SELECT count(*)::int FROM u)`,

		// The lease-mode claim commits on its own (one statement, one
		// round trip), gated on the key's lock as the claim is: a new key
		// is inserted in progress, and a key whose lease ran out is taken
		// over with a new token, which fences the original out. ON
		// CONFLICT re-reads the latest row, so two deliveries after the
		// lease ran out cannot both take it over. xmax is 0 for a row this
		// statement inserted, not updated.
		// lock_timeout, set for the statement's own transaction before
		// ON CONFLICT can wait for a lock on the row (a completion that is
		// committing), bounds that wait.
		ClaimLease: `WITH s AS MATERIALIZED (SELECT set_config('lock_timeout', $7, true))
INSERT INTO ` + q + ` AS r (source, event_id, payload_digest, lease_until, lease_token)
SELECT $1, $2, $3, now() + $5 * interval '1 microsecond', $6 FROM s WHERE pg_try_advisory_xact_lock($4)
ON CONFLICT (source, event_id) DO UPDATE
SET payload_digest = excluded.payload_digest, lease_until = excluded.lease_until,
    lease_token = excluded.lease_token, claimed_at = now()
WHERE r.completed_at IS NULL AND r.lease_until < now()
RETURNING r.xmax <> 0`,
		CompleteLease: completeLease,
		CompleteLeaseOrFail: `WITH u AS (` + completeLease + `
RETURNING 1)
SELECT 1 / (SELECT count(*)::int FROM u)`,
		ReleaseLease: `DELETE FROM ` + q + `
WHERE source = $1 AND event_id = $2 AND lease_token = $3 AND completed_at IS NULL`,
		KeepClaim: `UPDATE ` + q + ` SET lease_until = NULL
WHERE source = $1 AND event_id = $2 AND lease_token = $3 AND completed_at IS NULL`,
		ExtendLease: `UPDATE ` + q + ` SET lease_until = now() + $4 * interval '1 microsecond'
WHERE source = $1 AND event_id = $2 AND lease_token = $3 AND completed_at IS NULL`,
		// A single-transaction claim of a key whose lease ran out: the row
		// becomes this transaction's claim, and the old token is gone.
		TakeOver: `UPDATE ` + q + `
SET payload_digest = $3, lease_until = NULL, lease_token = NULL, claimed_at = now()
WHERE source = $1 AND event_id = $2 AND completed_at IS NULL AND lease_until < now()
  AND pg_try_advisory_xact_lock($4)`,
	}
}

// Filled in by package idem when it is initialized, for adapters outside it
// (idempgx imports idem, so idem is initialized first).
var (
	// NewMiddleware returns an *idem.Middleware for opts (an idem.Options)
	// that claims keys through pool.
	NewMiddleware func(pool Pool, opts any) (any, error)
	// HandleFromContext returns the Handle of the request's transaction.
	HandleFromContext func(ctx context.Context) (any, bool)
)
