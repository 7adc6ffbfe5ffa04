package idemops

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/catalog"
)

// One key at a time: ShowKey looks at one, ListKeys lists the keys in a
// state, ForgetKey deletes one so that its next delivery runs the handler
// again (forget.go). They are what the idem keys command and the idemui
// pages run.

// Errors of ShowKey, ListKeys and ForgetKey, for errors.Is.
var (
	// ErrKeyNotFound: the table holds no committed row for the key, and
	// no session holds its lock. Never delivered, rolled back every time,
	// or swept.
	ErrKeyNotFound = errors.New("idem: key not found")
	// ErrKeyInFlight: a session holds the key's lock: a claim in flight
	// (its row, if any, is not committed yet) or a duplicate looking it up.
	ErrKeyInFlight = errors.New("idem: key in flight")
	// ErrLeaseLive: the key is a lease-mode claim whose lease still runs:
	// its handler may still be at work, and may still store its answer.
	ErrLeaseLive = errors.New("idem: key under a live lease")
)

// KeyState is what a key is, as ShowKey and ListKeys see it.
type KeyState int

// The states of a key.
const (
	// KeyCompleted: committed with a stored answer, which every
	// redelivery is answered with.
	KeyCompleted KeyState = iota + 1
	// KeyUnanswered: committed without an answer and not a lease-mode
	// claim: a handler ended the middleware's transaction itself. Every
	// redelivery is answered 409 until an operator resolves it.
	KeyUnanswered
	// KeyLeased: a lease-mode claim whose lease still runs (LeaseUntil):
	// its handler is at work.
	KeyLeased
	// KeyLeaseExpired: a lease-mode claim whose lease ran out without an
	// answer: its original crashed or was killed; the next delivery takes
	// it over and runs the handler again.
	KeyLeaseExpired
	// KeyInFlight: no committed row, but a session holds the key's lock: a
	// claim in flight, invisible until it commits (KeyInfo.HolderPID).
	KeyInFlight
)

// String returns "completed", "unanswered", "leased", "lease_expired" or
// "in_flight", the names the idem command prints.
func (s KeyState) String() string {
	switch s {
	case KeyCompleted:
		return "completed"
	case KeyUnanswered:
		return "unanswered"
	case KeyLeased:
		return "leased"
	case KeyLeaseExpired:
		return "lease_expired"
	case KeyInFlight:
		return "in_flight"
	}
	return "KeyState(" + strconv.Itoa(int(s)) + ")"
}

// KeyInfo is one key: its state, times and stored answer. Times are zero
// where the key has none.
type KeyInfo struct {
	Key   idem.Key
	State KeyState
	// CheckedAt is the database's now() when the key was read; a lease is
	// live when LeaseUntil is after it.
	CheckedAt   time.Time
	ClaimedAt   time.Time
	CompletedAt time.Time
	// LeaseUntil is when a lease-mode claim's lease ends (or ended).
	LeaseUntil time.Time
	// Status and Headers are the stored answer (0 and nil without one);
	// BodySize is the stored body's length in bytes.
	Status   int
	Headers  http.Header
	BodySize int
	// Body is the stored body, only when asked for (KeyOptions.Body):
	// bodies can hold personal data.
	Body []byte
	// PayloadDigest is the SHA-256 of the request body that was processed,
	// in hex: compare it with sha256sum of a delivery you hold.
	PayloadDigest string
	// Partition is the partition that holds the row, on a partitioned
	// table; "" on a plain one.
	Partition string
	// InFlight is true when a session holds the key's lock now, and
	// HolderPID is that session's process id.
	InFlight  bool
	HolderPID int
}

// KeyOptions names one key of a table, for ShowKey.
type KeyOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it.
	Table string
	// Key is the key: its source and event id, exactly as stored.
	Key idem.Key
	// Body asks for the stored body (KeyInfo.Body). Off by default:
	// bodies can hold personal data.
	Body bool
}

// keyColumns are the columns a KeyInfo is read from, scanned by scanKey.
const keyColumns = `source, event_id, claimed_at, completed_at, lease_until, response_status,
       response_headers, coalesce(octet_length(response_body), 0), encode(payload_digest, 'hex'),
       CASE WHEN tableoid = to_regclass($1) THEN '' ELSE tableoid::regclass::text END, now()`

// scanKey scans the keyColumns (and body, when not nil) into k and sets
// its state from them.
func scanKey(scan func(...any) error, k *KeyInfo, body *[]byte) error {
	var (
		completed, lease sql.NullTime
		status           sql.NullInt32
		headers          []byte
	)
	dest := []any{&k.Key.Source, &k.Key.EventID, &k.ClaimedAt, &completed, &lease, &status,
		&headers, &k.BodySize, &k.PayloadDigest, &k.Partition, &k.CheckedAt}
	if body != nil {
		dest = append(dest, body)
	}
	if err := scan(dest...); err != nil {
		return err
	}
	k.CompletedAt, k.LeaseUntil, k.Status = completed.Time, lease.Time, int(status.Int32)
	if len(headers) > 0 {
		if err := json.Unmarshal(headers, &k.Headers); err != nil {
			return fmt.Errorf("stored headers of %q/%q: %w", k.Key.Source, k.Key.EventID, err)
		}
	}
	switch {
	case completed.Valid:
		k.State = KeyCompleted
	case !lease.Valid:
		k.State = KeyUnanswered
	case lease.Time.Before(k.CheckedAt):
		k.State = KeyLeaseExpired
	default:
		k.State = KeyLeased
	}
	return nil
}

// lockHolderSQL returns the process id of the session of this database
// that holds the advisory lock $1 (a bigint key: PostgreSQL shows its high
// half as classid, its low half as objid), 0 when none does.
const lockHolderSQL = `SELECT coalesce((SELECT l.pid FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (($1::bigint >> 32) & 4294967295)::oid AND l.objid = ($1::bigint & 4294967295)::oid
LIMIT 1), 0)`

// ShowKey reads one key: its committed row, and whether a session holds its
// lock. A key without a committed row is either in flight (State
// KeyInFlight) or not there: ErrKeyNotFound. It changes nothing, and reads
// the key by its primary key (on a partitioned table, each partition's).
func ShowKey(ctx context.Context, db *sql.DB, opts KeyOptions) (*KeyInfo, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	var k *KeyInfo
	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		if err := tableExists(ctx, tx, t); err != nil {
			return err
		}
		k, err = showKey(ctx, tx, t, opts.Key, opts.Body)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: show key %s: %w", describeKey(opts.Key), err)
	}
	return k, nil
}

// showKey reads one key in tx; ErrKeyNotFound when it has no row and no
// session holds its lock.
func showKey(ctx context.Context, tx *sql.Tx, t catalog.Table, key idem.Key, withBody bool) (*KeyInfo, error) {
	k := &KeyInfo{Key: key}
	q := `SELECT ` + keyColumns
	var body *[]byte
	if withBody {
		q += `, response_body`
		body = &k.Body
	}
	q += ` FROM ` + t.Quoted + ` WHERE source = $2 AND event_id = $3`
	err := scanKey(tx.QueryRowContext(ctx, q, t.Quoted, key.Source, key.EventID).Scan, k, body)
	found := err == nil
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return nil, err
	}
	if err := tx.QueryRowContext(ctx, lockHolderSQL, catalog.LockID(t.Rel, key.Source, key.EventID)).Scan(&k.HolderPID); err != nil {
		return nil, err
	}
	k.InFlight = k.HolderPID != 0
	if !found {
		if !k.InFlight {
			return nil, ErrKeyNotFound
		}
		k.State = KeyInFlight
		if err := tx.QueryRowContext(ctx, `SELECT now()`).Scan(&k.CheckedAt); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// describeKey renders a key for errors and logs: "source"/"event id",
// quoted, so that a key with spaces or control characters reads as one.
func describeKey(k idem.Key) string {
	return strconv.Quote(k.Source) + "/" + strconv.Quote(k.EventID)
}

// ListState selects the keys ListKeys lists.
type ListState string

// The states ListKeys takes.
const (
	// ListAll lists every committed key.
	ListAll ListState = "all"
	// ListUnanswered lists the keys committed without an answer that are
	// not lease-mode claims (KeyUnanswered).
	ListUnanswered ListState = "unanswered"
	// ListStuck lists the keys that answer 409 to a redelivery because
	// their owner is gone: unanswered ones and those whose lease ran out
	// (KeyUnanswered and KeyLeaseExpired). Claims in flight have no
	// committed row to list: Check lists their sessions.
	ListStuck ListState = "stuck"
	// ListLeased lists the lease-mode keys whose lease still runs.
	ListLeased ListState = "leased"
	// ListExpired lists the lease-mode keys whose lease ran out.
	ListExpired ListState = "expired"
)

// listConds are the WHERE conditions of each ListState.
var listConds = map[ListState]string{
	ListAll:        `true`,
	ListUnanswered: `completed_at IS NULL AND lease_until IS NULL`,
	ListStuck:      `completed_at IS NULL AND (lease_until IS NULL OR lease_until < now())`,
	ListLeased:     `completed_at IS NULL AND lease_until >= now()`,
	ListExpired:    `completed_at IS NULL AND lease_until < now()`,
}

// Limits of ListKeys.
const (
	// DefaultListLimit is how many keys ListKeys returns when
	// ListOptions.Limit is 0.
	DefaultListLimit = 50
	// MaxListLimit is the most keys one ListKeys call returns.
	MaxListLimit = 1000

	// listWindowMax is the widest window ListKeys reads before it reads
	// the rest of the table at once.
	listWindowMax = 60 * 24 * time.Hour
)

// ListOptions configures ListKeys. The zero value of every field means its
// documented default.
type ListOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable.
	Table string
	// State selects the keys; "" means ListAll.
	State ListState
	// Source, when not "", lists only the keys of that source (exactly).
	Source string
	// Since, when not zero, lists only the keys claimed at or after it.
	Since time.Time
	// Before, when not zero, lists only the keys claimed before it: pass
	// the ClaimedAt of the last key of a page to get the next one.
	Before time.Time
	// Limit is the most keys returned, newest first. 0 means
	// DefaultListLimit (50); at most MaxListLimit (1000).
	Limit int
}

// ListKeys lists the committed keys in a state, newest first, without their
// bodies. The work is bounded: it reads keys newest first and stops at
// Limit matches, so a state with few keys on a large table reads the
// table's newest part until it has found them (narrow it with Since, which
// the claimed_at index and the partitions' bounds serve).
func ListKeys(ctx context.Context, db *sql.DB, opts ListOptions) ([]KeyInfo, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	if opts.State == "" {
		opts.State = ListAll
	}
	cond, ok := listConds[opts.State]
	switch {
	case !ok:
		return nil, fmt.Errorf("idem: list keys: unknown state %q (all, unanswered, stuck, leased or expired)", opts.State)
	case opts.Limit < 0 || opts.Limit > MaxListLimit:
		return nil, fmt.Errorf("idem: list keys: Limit %d is outside 0 to %d", opts.Limit, MaxListLimit)
	case opts.Limit == 0:
		opts.Limit = DefaultListLimit
	}
	var out []KeyInfo
	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		if err := tableExists(ctx, tx, t); err != nil {
			return err
		}
		args := []any{t.Quoted, 0, nil, nil}
		if opts.Source != "" {
			args = append(args, opts.Source)
			cond += ` AND source = $5`
		}
		q := `SELECT ` + keyColumns + ` FROM ` + t.Quoted + `
WHERE ` + cond + ` AND ($3::timestamptz IS NULL OR claimed_at >= $3) AND ($4::timestamptz IS NULL OR claimed_at < $4)
ORDER BY claimed_at DESC, source, event_id LIMIT $2`
		// Newest first, window by window back in time, each four times
		// the last, the last one unbounded: each query reads only the
		// blocks of its window (the claimed_at index, the partitions'
		// bounds), and the walk stops as soon as Limit keys are found.
		var hi time.Time
		if err := tx.QueryRowContext(ctx, `SELECT now()`).Scan(&hi); err != nil {
			return err
		}
		if !opts.Before.IsZero() {
			hi = opts.Before
		}
		width := time.Hour
		for first := true; len(out) < opts.Limit; first = false {
			lo := hi.Add(-width)
			if width > listWindowMax || (!opts.Since.IsZero() && lo.Before(opts.Since)) {
				lo = opts.Since // zero: unbounded below
			}
			args[1] = opts.Limit - len(out)
			args[2] = sql.NullTime{Time: lo, Valid: !lo.IsZero()}
			// The first window has no upper bound but Before: a key claimed
			// after now() by a clock ahead of the database's is listed too.
			args[3] = sql.NullTime{Time: hi, Valid: !first || !opts.Before.IsZero()}
			rows, err := tx.QueryContext(ctx, q, args...)
			if err != nil {
				return err
			}
			for rows.Next() {
				var k KeyInfo
				if err := scanKey(rows.Scan, &k, nil); err != nil {
					rows.Close()
					return err
				}
				out = append(out, k)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			if lo.IsZero() || lo.Equal(opts.Since) {
				break
			}
			hi, width = lo, width*4
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idem: list keys of %s: %w", t.Name, err)
	}
	return out, nil
}

// maxFindSources bounds the sources FindKeys looks in.
const maxFindSources = 10000

// FindKeys finds an event id under every source: often all an on-call
// engineer has is the id from a provider's dashboard. It walks the
// table's distinct sources through the primary key (a loose index scan)
// and looks the id up under each, so its work grows with the number of
// sources (at most 10,000), not of keys. Keys in flight are not found:
// they have no committed row, and their lock names no source.
func FindKeys(ctx context.Context, db *sql.DB, table, eventID string) ([]KeyInfo, error) {
	t, err := catalog.ParseTable(table)
	if err != nil {
		return nil, err
	}
	var out []KeyInfo
	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		if err := tableExists(ctx, tx, t); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `WITH RECURSIVE s(source, n) AS (
    (SELECT source, 1 FROM `+t.Quoted+` ORDER BY source LIMIT 1)
    UNION ALL
    SELECT (SELECT source FROM `+t.Quoted+` WHERE source > s.source ORDER BY source LIMIT 1), s.n + 1
    FROM s WHERE s.source IS NOT NULL AND s.n < `+strconv.Itoa(maxFindSources)+`)
SELECT `+keyColumns+` FROM `+t.Quoted+`
WHERE (source, event_id) IN (SELECT s.source, $2 FROM s WHERE s.source IS NOT NULL)
ORDER BY claimed_at DESC, source`, t.Quoted, eventID)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var k KeyInfo
			if err := scanKey(rows.Scan, &k, nil); err != nil {
				return err
			}
			out = append(out, k)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("idem: find event id %q in %s: %w", eventID, t.Name, err)
	}
	return out, nil
}
