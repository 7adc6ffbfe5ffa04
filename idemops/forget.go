package idemops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/catalog"
)

// ForgetOptions names the key ForgetKey deletes, and who asks.
type ForgetOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable.
	Table string
	// Key is the key to delete, exactly as stored.
	Key idem.Key
	// Force deletes a key under a live lease, or whose lock a session
	// holds, all the same. Its handler may still be at work: a lease-mode
	// original that finishes after the delete stores nothing (its lease
	// token is gone), but its side effects happen, and the next delivery
	// runs the handler again beside them.
	Force bool
	// Reason and Actor go into the audit log line: why the key is
	// forgotten (a ticket, an incident) and who asked (a user name).
	Reason, Actor string
	// Logger receives the audit line; nil means slog.Default().
	Logger *slog.Logger
	// LockTimeout bounds the wait for the key's row when a session holds
	// it (only with Force: otherwise such a key is refused at once).
	// 0 means 5s.
	LockTimeout time.Duration
}

// Forgotten is what ForgetKey removed: the key as it was, without its body.
type Forgotten struct {
	KeyInfo
	// Forced is true when Force overrode a refusal: the key was in flight
	// or under a live lease when it was deleted.
	Forced bool
}

// ForgetKey deletes one committed key, so that its next delivery runs the
// handler again. It refuses, with ErrKeyInFlight or ErrLeaseLive, a key
// whose lock a session holds (a claim in flight, or a duplicate reading it)
// or whose lease still runs, unless opts.Force; a key without a committed
// row is ErrKeyNotFound (a claim in flight has none to delete, even with
// Force: end its session instead). The key's lock is held from the check
// to the delete, so no claim of the key starts in between. It logs one line,
// "idem: key forgotten", with the key, its state, who asked and why, at
// level Warn, whatever the caller does with the result.
//
// Instances that replayed the key keep its answer in memory for
// idem.Options.ReplayCacheTTL (1 minute by default): on them the key runs
// again only after that.
func ForgetKey(ctx context.Context, db *sql.DB, opts ForgetOptions) (*Forgotten, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	wait := opts.LockTimeout
	switch {
	case wait < 0:
		return nil, fmt.Errorf("idem: forget: LockTimeout %v is negative", wait)
	case wait == 0:
		wait = 5 * time.Second
	}
	f, err := forget(ctx, db, t, opts, wait)
	if err != nil {
		return nil, fmt.Errorf("idem: forget key %s: %w", describeKey(opts.Key), err)
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	attrs := []any{
		slog.String("table", t.Name), slog.String("source", f.Key.Source), slog.String("event_id", f.Key.EventID),
		slog.String("state", f.State.String()), slog.Bool("forced", f.Forced),
		slog.Time("claimed_at", f.ClaimedAt), slog.Int("status", f.Status),
		slog.String("actor", opts.Actor), slog.String("reason", opts.Reason),
	}
	if f.Partition != "" {
		attrs = append(attrs, slog.String("partition", f.Partition))
	}
	log.WarnContext(ctx, "idem: key forgotten", attrs...)
	return f, nil
}

func forget(ctx context.Context, db *sql.DB, t catalog.Table, opts ForgetOptions, wait time.Duration) (*Forgotten, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	if err := tableExists(ctx, tx, t); err != nil {
		return nil, err
	}
	// The key's lock first, without waiting: held, it keeps a new claim of
	// the key from starting until the delete commits; not granted, a
	// session holds it.
	var locked bool
	if err := tx.QueryRowContext(ctx, `SELECT pg_try_advisory_xact_lock($1)`, catalog.LockID(t.Rel, opts.Key.Source, opts.Key.EventID)).Scan(&locked); err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = %d`, max(1, wait.Milliseconds()))); err != nil { // 0 would wait forever
		return nil, err
	}
	f := &Forgotten{}
	lockRow := ` FOR UPDATE NOWAIT`
	if opts.Force {
		lockRow = ` FOR UPDATE`
	}
	err = scanKey(tx.QueryRowContext(ctx, `SELECT `+keyColumns+` FROM `+t.Quoted+`
WHERE source = $2 AND event_id = $3`+lockRow, t.Quoted, opts.Key.Source, opts.Key.EventID).Scan, &f.KeyInfo, nil)
	switch {
	case errors.Is(err, sql.ErrNoRows) && !locked:
		return nil, fmt.Errorf("%w: no committed row, and a session holds its lock: a claim in flight, which has no row to delete until it ends (idem check lists its session)", ErrKeyInFlight)
	case errors.Is(err, sql.ErrNoRows):
		return nil, ErrKeyNotFound
	case isLockNotAvailable(err):
		return nil, fmt.Errorf("%w: a session is changing its row now (-force waits for it)", ErrKeyInFlight)
	case err != nil:
		return nil, err
	}
	f.InFlight = !locked
	switch {
	case f.InFlight && !opts.Force:
		return nil, fmt.Errorf("%w: a session holds its lock (a duplicate reading it, or a lease takeover); try again, or force it", ErrKeyInFlight)
	case f.State == KeyLeased && !opts.Force:
		return nil, fmt.Errorf("%w until %s: its handler may still be at work and store its answer; wait for the lease to end, or force it", ErrLeaseLive, f.LeaseUntil.UTC().Format(time.RFC3339))
	}
	f.Forced = f.InFlight || f.State == KeyLeased
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+t.Quoted+` WHERE source = $1 AND event_id = $2`, opts.Key.Source, opts.Key.EventID); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	return f, nil
}

// isLockNotAvailable reports whether err is PostgreSQL's lock_not_available
// (SQLSTATE 55P03): NOWAIT found the row locked, or lock_timeout ran out.
func isLockNotAvailable(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "55P03"
}
