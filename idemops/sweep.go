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

// Retention and sweep defaults, for the zero values of SweepOptions.
const (
	// DefaultRetention is how long a key is kept when SweepOptions.Retention
	// is 0: ten times the longest common automatic retry horizon (Stripe and
	// Paddle retry for 3 days), which also covers a manual replay weeks
	// later.
	DefaultRetention = 30 * 24 * time.Hour

	// MinSafeRetention is the shortest retention Sweep accepts unless
	// SweepOptions.UnsafeShortRetention is set: 72 hours, the retry horizon
	// of Stripe (live mode), Paddle and Standard Webhooks senders.
	MinSafeRetention = 72 * time.Hour

	// DefaultSweepBatch is the most keys one sweep transaction deletes.
	DefaultSweepBatch = 5000

	// MaxSweepBatch bounds SweepOptions.BatchSize: a batch is one
	// transaction, and it must stay short.
	MaxSweepBatch = 100_000

	// DefaultSweepMaxBatches is the most batches one Sweep runs: with
	// DefaultSweepBatch, one million keys per run.
	DefaultSweepMaxBatches = 200

	// DefaultSweepPause is the pause between two batches, which leaves the
	// claim path, replication and autovacuum room between deletes.
	DefaultSweepPause = 200 * time.Millisecond
)

// ErrUnsafeRetention is returned (wrapped) by Sweep and RunSweeper for a
// retention under MinSafeRetention without SweepOptions.UnsafeShortRetention.
var ErrUnsafeRetention = errors.New("idem: retention shorter than the providers' retry horizon")

// SweepOptions configures Sweep and RunSweeper. The zero value of every field
// means its documented default.
type SweepOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it.
	Table string

	// Retention is how long a key is kept after its claim: a key whose
	// claimed_at is older than the database's now() minus Retention is
	// deleted, and a later delivery with that key runs the handler again.
	// Keep it well above the longest retry horizon of every sender (see
	// docs/operations.md). 0 means DefaultRetention (30 days);
	// values under MinSafeRetention (72h) are refused unless
	// UnsafeShortRetention is set.
	Retention time.Duration

	// UnsafeShortRetention accepts a Retention under MinSafeRetention. A
	// key deleted while its sender still retries lets that retry run the
	// side effect a second time: set it only for senders whose retry
	// horizon you know to be shorter (and for tests).
	UnsafeShortRetention bool

	// BatchSize is the most keys one transaction deletes. 0 means
	// DefaultSweepBatch (5000); at most MaxSweepBatch.
	BatchSize int

	// MaxBatches caps the batches of one Sweep call, so that a backlog is
	// worked off over several runs instead of in one long one. 0 means
	// DefaultSweepMaxBatches (200).
	MaxBatches int

	// Pause is the wait between two batches. 0 means DefaultSweepPause
	// (200ms); a negative value means no pause.
	Pause time.Duration

	// Logger receives one record per run (Info; Warn when the run stopped
	// at MaxBatches; Error when it failed) and one per batch (Debug). nil
	// means slog.Default(); to silence it, pass
	// slog.New(slog.DiscardHandler).
	Logger *slog.Logger

	// Observer, if set, is called at the end of every Sweep (so after each
	// run of RunSweeper) with its result and error, for metrics. It runs on
	// the sweeping goroutine: keep it fast.
	Observer func(SweepResult, error)

	// PartitionsAhead is how many partitions after the current one a sweep
	// of a partitioned table keeps ready (see idem.MigrateOptions). 0 means
	// idem.DefaultPartitionsAhead (3).
	PartitionsAhead int
}

// SweepResult is what one Sweep did.
type SweepResult struct {
	Removed  int64         // keys deleted, over all batches
	Batches  int           // delete transactions run, the last one included even when it found nothing
	Capped   bool          // the run stopped at MaxBatches after a full batch: expired keys may remain
	Duration time.Duration // from the start of the first batch to the end of the run

	// On a partitioned table, expired keys go with their partitions, and
	// Batches is 0: PartitionsDropped counts the partitions dropped (their
	// keys are in Removed), PartitionsCreated those added ahead.
	PartitionsDropped, PartitionsCreated int
}

// sweeper is a validated SweepOptions.
type sweeper struct {
	table     catalog.Table
	deleteSQL string
	// distributedDeleteSQL is deleteSQL for a table distributed by Citus.
	distributedDeleteSQL string
	retention            time.Duration
	batch                int
	maxBatches           int
	pause                time.Duration
	logger               *slog.Logger
	observer             func(SweepResult, error)
	ahead                int // partitions kept ready ahead, on a partitioned table
}

func newSweeper(opts SweepOptions) (*sweeper, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	s := &sweeper{
		table:      t,
		retention:  opts.Retention,
		batch:      opts.BatchSize,
		maxBatches: opts.MaxBatches,
		pause:      opts.Pause,
		logger:     opts.Logger,
		observer:   opts.Observer,
		ahead:      opts.PartitionsAhead,
	}
	if opts.PartitionsAhead < 0 {
		return nil, fmt.Errorf("idem: sweep: partitions ahead %d is negative", opts.PartitionsAhead)
	}
	if s.ahead == 0 {
		s.ahead = idem.DefaultPartitionsAhead
	}
	switch {
	case s.retention == 0:
		s.retention = DefaultRetention
	case s.retention < 0:
		return nil, fmt.Errorf("idem: sweep: retention %v is negative", s.retention)
	case s.retention < MinSafeRetention && !opts.UnsafeShortRetention:
		return nil, fmt.Errorf("%w: %v is under %v, and a key deleted while its sender still retries lets that retry run the handler twice (Stripe and Paddle retry for 3 days); accept that risk with SweepOptions.UnsafeShortRetention (idem sweep -unsafe-short-retention) only if every sender stops retrying sooner",
			ErrUnsafeRetention, s.retention, MinSafeRetention)
	}
	switch {
	case s.batch == 0:
		s.batch = DefaultSweepBatch
	case s.batch < 0 || s.batch > MaxSweepBatch:
		return nil, fmt.Errorf("idem: sweep: batch size %d is not between 1 and %d", s.batch, MaxSweepBatch)
	}
	switch {
	case s.maxBatches == 0:
		s.maxBatches = DefaultSweepMaxBatches
	case s.maxBatches < 0:
		return nil, fmt.Errorf("idem: sweep: max batches %d is negative", s.maxBatches)
	}
	switch {
	case s.pause == 0:
		s.pause = DefaultSweepPause
	case s.pause < 0:
		s.pause = 0
	}
	q := t.Quoted
	// One statement is one short transaction. The keys are chosen and
	// locked first, skipping rows another transaction has locked (a
	// concurrent sweep, an operator's UPDATE), and deleted by primary key:
	// no ctid, which distributed Postgres-compatible engines do not keep
	// stable. Claims in flight are uncommitted inserts, invisible here, so
	// they are never chosen. The cutoff uses the database's clock only. No
	// ORDER BY: every chosen row is expired, and sorting would read all of
	// them per batch; keys are appended in claimed_at order, so the scan
	// (sequential, or through the BRIN index on large tables) meets the
	// oldest first anyway.
	expired := `DELETE FROM ` + q + ` WHERE (source, event_id) IN (
    SELECT source, event_id FROM ` + q + `
    WHERE claimed_at < now() - $1::bigint * interval '1 microsecond'
      AND (lease_until IS NULL OR lease_until < now()) -- never a live lease
    LIMIT $2`
	s.deleteSQL = expired + `
    FOR UPDATE SKIP LOCKED)`
	// Citus runs no FOR UPDATE over a distributed table's shards: it
	// gathers the batch's keys on the coordinator, then deletes them from
	// the shards, in one distributed transaction. A row that another
	// transaction locks meanwhile (a concurrent sweep) is waited for, and
	// then found gone.
	s.distributedDeleteSQL = expired + `)`
	return s, nil
}

// Sweep deletes the keys claimed more than opts.Retention ago, in batches of
// at most opts.BatchSize keys, each batch its own short transaction, with
// opts.Pause between batches. It stops when a batch finds fewer keys than
// the batch size (nothing expired is left), after opts.MaxBatches batches,
// or when ctx is done; it returns what it removed so far in every case,
// with ctx's error in the last one.
//
// Claims in flight are never deleted, and rows that another transaction has
// locked are skipped (so two sweeps running at once do not wait on each
// other). Claims keep succeeding while a sweep runs: a redelivery of a key
// that a batch is deleting waits for that batch to commit, then runs the
// handler as a new delivery.
func Sweep(ctx context.Context, db *sql.DB, opts SweepOptions) (SweepResult, error) {
	s, err := newSweeper(opts)
	if err != nil {
		return SweepResult{}, err
	}
	return s.run(ctx, db)
}

func (s *sweeper) run(ctx context.Context, db *sql.DB) (res SweepResult, err error) {
	start := time.Now()
	defer func() {
		res.Duration = time.Since(start)
		s.report(ctx, res, err)
	}()
	if kind, err := catalog.RelKind(ctx, db, s.table); err != nil {
		return res, fmt.Errorf("idem: sweep %s: %w", s.table.Name, err)
	} else if kind == 'p' {
		return s.runPartitions(ctx, db)
	}
	deleteSQL := s.deleteSQL
	if dist, err := catalog.Distributed(ctx, db, s.table); err != nil {
		return res, fmt.Errorf("idem: sweep %s: %w", s.table.Name, err)
	} else if dist {
		deleteSQL = s.distributedDeleteSQL
	}
	for res.Batches < s.maxBatches {
		if res.Batches > 0 && s.pause > 0 {
			if err := sleep(ctx, s.pause); err != nil {
				return res, fmt.Errorf("idem: sweep %s: %w", s.table.Name, err)
			}
		}
		n, err := s.batchOnce(ctx, db, deleteSQL)
		if err != nil {
			return res, fmt.Errorf("idem: sweep %s: batch %d: %w", s.table.Name, res.Batches+1, err)
		}
		res.Batches++
		res.Removed += n
		s.logr().LogAttrs(ctx, slog.LevelDebug, "idem: sweep batch",
			slog.String("table", s.table.Name), slog.Int("batch", res.Batches), slog.Int64("removed", n))
		if n < int64(s.batch) {
			return res, nil
		}
	}
	res.Capped = true
	return res, nil
}

func (s *sweeper) batchOnce(ctx context.Context, db *sql.DB, deleteSQL string) (int64, error) {
	r, err := db.ExecContext(ctx, deleteSQL, s.retention.Microseconds(), s.batch)
	if err != nil {
		return 0, err
	}
	return r.RowsAffected()
}

// report logs and observes the end of a run.
func (s *sweeper) report(ctx context.Context, res SweepResult, err error) {
	if s.observer != nil {
		s.observer(res, err)
	}
	log := s.logr()
	attrs := []slog.Attr{
		slog.String("table", s.table.Name),
		slog.Int64("removed", res.Removed),
		slog.Int("batches", res.Batches),
		slog.Bool("capped", res.Capped),
		slog.Duration("retention", s.retention),
		slog.Duration("duration", res.Duration),
	}
	if res.PartitionsDropped+res.PartitionsCreated > 0 {
		attrs = append(attrs, slog.Int("partitions_dropped", res.PartitionsDropped), slog.Int("partitions_created", res.PartitionsCreated))
	}
	switch {
	case err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()):
		log.LogAttrs(ctx, slog.LevelInfo, "idem: sweep interrupted", append(attrs, slog.Any("error", err))...)
	case err != nil:
		log.LogAttrs(ctx, slog.LevelError, "idem: sweep failed", append(attrs, slog.Any("error", err))...)
	case res.Capped:
		log.LogAttrs(ctx, slog.LevelWarn, "idem: sweep stopped at the batch cap; expired keys remain (raise MaxBatches or BatchSize, or sweep more often)", attrs...)
	default:
		log.LogAttrs(ctx, slog.LevelInfo, "idem: sweep done", attrs...)
	}
}

// logr is SweepOptions.Logger, or slog.Default() as it is now.
func (s *sweeper) logr() *slog.Logger {
	if s.logger != nil {
		return s.logger
	}
	return slog.Default()
}

// RunSweeper runs Sweep at once and then every interval (counted from the
// end of one run to the start of the next) until ctx is done; then it
// returns nil. Invalid options or interval are returned at once. A failed
// run is logged and reported to opts.Observer, and the next run is tried at
// the next interval. RunSweeper starts no goroutine: run it in one of yours
// and cancel ctx to stop it; when it returns, nothing of it is left running.
func RunSweeper(ctx context.Context, db *sql.DB, opts SweepOptions, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("idem: sweeper interval %v must be positive", interval)
	}
	s, err := newSweeper(opts)
	if err != nil {
		return err
	}
	for {
		_, _ = s.run(ctx, db) // logged and observed by run
		if err := sleep(ctx, interval); err != nil {
			return nil
		}
	}
}

// sleep waits for d or until ctx is done, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
