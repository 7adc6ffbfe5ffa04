package idemops

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSweepStopsAtTheBatchCapAndTheNextRunGoesOn(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newPlainTable(t, db)
	insertKeys(t, db, table, "old_", 25, 31*day)
	opts := SweepOptions{Table: table, BatchSize: 10, MaxBatches: 2, Pause: -1}

	res, err := Sweep(context.Background(), db, opts)
	require.NoError(t, err)
	assert.Equal(t, SweepResult{Removed: 20, Batches: 2, Capped: true}, zeroDuration(res))
	assert.Equal(t, 5, countKeys(t, db, table, "old_"))

	res, err = Sweep(context.Background(), db, opts)
	require.NoError(t, err)
	assert.Equal(t, SweepResult{Removed: 5, Batches: 1}, zeroDuration(res))
	assert.Zero(t, countKeys(t, db, table, "old_"))
}

func zeroDuration(r SweepResult) SweepResult {
	r.Duration = 0
	return r
}

func TestSweepValidatesItsOptions(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	ctx := context.Background()

	t.Run("the default retention is 30 days", func(t *testing.T) {
		table := newPlainTable(t, db)
		insertKeys(t, db, table, "d29_", 3, 29*day)
		insertKeys(t, db, table, "d31_", 2, 31*day)
		res, err := Sweep(ctx, db, SweepOptions{Table: table, Pause: -1})
		require.NoError(t, err)
		assert.Equal(t, int64(2), res.Removed)
		assert.Equal(t, 3, countKeys(t, db, table, "d29_"))
	})

	t.Run("a retention under 72h is refused, and the error says why", func(t *testing.T) {
		table := newPlainTable(t, db)
		insertKeys(t, db, table, "k", 1, 71*time.Hour+time.Minute)
		_, err := Sweep(ctx, db, SweepOptions{Table: table, Retention: 71 * time.Hour})
		require.ErrorIs(t, err, ErrUnsafeRetention)
		for _, want := range []string{"71h0m0s", "72h0m0s", "still retries", "twice", "UnsafeShortRetention"} {
			assert.Contains(t, err.Error(), want)
		}
		assert.Equal(t, 1, countKeys(t, db, table, "k"), "nothing deleted")
	})

	t.Run("a short retention is accepted with UnsafeShortRetention", func(t *testing.T) {
		table := newPlainTable(t, db)
		insertKeys(t, db, table, "h2_", 1, 2*time.Hour)
		insertKeys(t, db, table, "now_", 1, 0)
		res, err := Sweep(ctx, db, SweepOptions{Table: table, Retention: time.Hour, UnsafeShortRetention: true, Pause: -1})
		require.NoError(t, err)
		assert.Equal(t, int64(1), res.Removed)
		assert.Equal(t, 1, countKeys(t, db, table, "now_"))
	})

	for name, opts := range map[string]SweepOptions{
		"a negative retention":            {Retention: -time.Hour, UnsafeShortRetention: true},
		"a negative batch size":           {BatchSize: -1},
		"a batch size over MaxSweepBatch": {BatchSize: MaxSweepBatch + 1},
		"a negative batch cap":            {MaxBatches: -1},
		"an invalid table name":           {Table: "a.b.c"},
	} {
		t.Run(name+" is refused", func(t *testing.T) {
			_, err := Sweep(ctx, db, opts)
			require.Error(t, err)
			assert.True(t, strings.HasPrefix(err.Error(), "idem: "), err.Error())
		})
	}
}

// cancelOnBatch is a slog.Handler that cancels a context at the first
// batch record of a sweep.
type cancelOnBatch struct {
	slog.Handler
	cancel context.CancelFunc
}

func (h cancelOnBatch) Enabled(context.Context, slog.Level) bool { return true }

func (h cancelOnBatch) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "idem: sweep batch" {
		h.cancel()
	}
	return nil
}

func TestSweepStopsDuringThePauseWhenCanceled(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newPlainTable(t, db)
	insertKeys(t, db, table, "old_", 30, 31*day)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The first batch cancels ctx; the hour-long pause after it must end
	// at once.
	res, err := Sweep(ctx, db, SweepOptions{
		Table: table, BatchSize: 10, Pause: time.Hour,
		Logger: slog.New(cancelOnBatch{cancel: cancel}),
	})
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, int64(10), res.Removed, "what was removed before the stop is reported")
	assert.Equal(t, 1, res.Batches)
	assert.Equal(t, 20, countKeys(t, db, table, "old_"))
}

// jsonRecords decodes the JSON log records a logBuffer holds.
func jsonRecords(t *testing.T, logs *logBuffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "%s", line)
		out = append(out, rec)
	}
	return out
}

type run struct {
	res SweepResult
	err error
}

// startSweeper runs RunSweeper in a goroutine; runs receives every run and
// stop cancels it and returns what RunSweeper returned.
func startSweeper(t *testing.T, db *sql.DB, opts SweepOptions, interval time.Duration) (runs <-chan run, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan run)
	opts.Observer = func(r SweepResult, err error) {
		select {
		case ch <- run{r, err}:
		case <-ctx.Done():
		}
	}
	returned := make(chan error, 1)
	go func() { returned <- RunSweeper(ctx, db, opts, interval) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-returned:
			case <-time.After(10 * time.Second):
				err = errors.New("RunSweeper did not return within 10 s of its context's end")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return ch, stop
}

func TestRunSweeperSweepsEveryIntervalUntilCanceled(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newPlainTable(t, db)
	insertKeys(t, db, table, "first_", 7, 31*day)
	var logs logBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))

	runs, stop := startSweeper(t, db, SweepOptions{Table: table, Pause: -1, Logger: logger}, time.Millisecond)
	first := <-runs
	require.NoError(t, first.err)
	assert.Equal(t, int64(7), first.res.Removed, "the first run starts at once")

	// Later runs pick up what expired since.
	insertKeys(t, db, table, "later_", 3, 31*day)
	for r := range runs {
		require.NoError(t, r.err)
		if r.res.Removed > 0 {
			assert.Equal(t, int64(3), r.res.Removed)
			break
		}
	}
	require.NoError(t, stop(), "a canceled sweeper returns nil")

	// One structured record per run.
	recs := jsonRecords(t, &logs)
	require.NotEmpty(t, recs)
	rec := recs[0]
	assert.Equal(t, "INFO", rec["level"])
	assert.Equal(t, "idem: sweep done", rec["msg"])
	assert.Equal(t, table, rec["table"])
	assert.Equal(t, float64(7), rec["removed"])
	assert.Equal(t, float64(1), rec["batches"])
	assert.Equal(t, false, rec["capped"])
	assert.Equal(t, float64(DefaultRetention), rec["retention"])
	assert.Contains(t, rec, "duration")
}

func TestRunSweeperKeepsGoingAfterAFailedRun(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	var logs logBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))

	runs, stop := startSweeper(t, db, SweepOptions{Table: "no_such_table", Logger: logger}, time.Millisecond)
	for range 2 {
		r := <-runs
		require.Error(t, r.err)
		assert.Contains(t, r.err.Error(), "no_such_table")
	}
	require.NoError(t, stop())
	rec := jsonRecords(t, &logs)[0]
	assert.Equal(t, "ERROR", rec["level"])
	assert.Equal(t, "idem: sweep failed", rec["msg"])
	assert.Contains(t, rec["error"], "no_such_table")
}

func TestRunSweeperStopsWhileWaitingForTheNextRun(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newPlainTable(t, db)
	runs, stop := startSweeper(t, db, SweepOptions{Table: table}, time.Hour)
	require.NoError(t, (<-runs).err)
	require.NoError(t, stop(), "the hour's wait ends with the context")
}

func TestRunSweeperRefusesInvalidSettingsAtOnce(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	err := RunSweeper(context.Background(), db, SweepOptions{}, 0)
	assert.ErrorContains(t, err, "interval")
	err = RunSweeper(context.Background(), db, SweepOptions{Retention: time.Hour}, time.Minute)
	assert.ErrorIs(t, err, ErrUnsafeRetention)
}

// A nil SweepOptions.Logger means slog.Default() on a partitioned table too:
// the partitions a sweep drops are logged there, as the batches of a plain
// table's sweep are. (Not parallel: it swaps slog's default logger.)
func TestPartitionedSweepLogsToTheDefaultLogger(t *testing.T) {
	db := openDB(t)
	table := newPartitionedTable(t, db, 24*time.Hour)
	var logs logBuffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	defer slog.SetDefault(old)

	// The partition from MINVALUE ends at the start of today (UTC), so a
	// millisecond's retention drops it.
	res, err := Sweep(context.Background(), db, SweepOptions{Table: table, Retention: time.Millisecond, UnsafeShortRetention: true})
	require.NoError(t, err)
	require.Equal(t, 1, res.PartitionsDropped)
	var dropped []map[string]any
	for _, rec := range jsonRecords(t, &logs) {
		if rec["msg"] == "idem: sweep dropped a partition" {
			dropped = append(dropped, rec)
		}
	}
	require.Len(t, dropped, 1, "%s", logs.String())
	assert.Equal(t, table, dropped[0]["table"])
}
