package idem_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const day = 24 * time.Hour

// insertKeys commits n completed keys "<prefix><i>" of source "test", claimed
// age ago (plus i milliseconds, in insertion order, as real claims are), in
// one statement. Their stored answer is 200 "ok" for the body "{}", so the
// fixture's deliveries of them are replayed.
func insertKeys(t testing.TB, db *sql.DB, table, prefix string, n int, age time.Duration) {
	t.Helper()
	_, err := db.Exec(`INSERT INTO "`+table+`" (source, event_id, payload_digest,
    response_status, response_headers, response_body, claimed_at, completed_at)
SELECT 'test', $1 || g, sha256('{}'::bytea), 200, '{"Content-Type": ["text/plain"]}', 'ok', c, c
FROM generate_series(1, $2::int) AS g,
     LATERAL (SELECT now() - $3::bigint * interval '1 microsecond' + g * interval '1 millisecond') AS x(c)`,
		prefix, n, age.Microseconds())
	require.NoError(t, err)
}

// countKeys counts the committed keys whose event id starts with prefix.
func countKeys(t testing.TB, db *sql.DB, table, prefix string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM "`+table+`" WHERE starts_with(event_id, $1)`, prefix).Scan(&n))
	return n
}

// gateSeq numbers the advisory locks the tests use as gates; far from the
// middleware's 64-bit hashes, and distinct per test in this binary.
var gateSeq atomic.Int64

// waitForGateWaiter returns when a session of the test database waits for
// the advisory lock key (a small positive number: classid 0, objid key).
func waitForGateWaiter(t *testing.T, db *sql.DB, key int64) {
	t.Helper()
	waitFor(t, fmt.Sprintf("a session waiting for gate %d", key), func() bool {
		var n int
		err := db.QueryRow(`SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND classid = 0 AND objid = $1 AND objsubid = 1
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, key).Scan(&n)
		require.NoError(t, err)
		return n > 0
	})
}

// auditDeletes installs a statement-level trigger that records, for every
// DELETE on table, its transaction and how many rows it removed, and that
// waits at the end of each DELETE for the advisory lock gate (shared, so it
// only waits while the test holds the gate). It returns the audit table.
func auditDeletes(t *testing.T, db *sql.DB, table string, gate int64) string {
	t.Helper()
	audit := "audit_" + table
	for _, stmt := range []string{
		`CREATE TABLE ` + audit + ` (txid bigint NOT NULL, removed bigint NOT NULL)`,
		`CREATE FUNCTION ` + audit + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ` + audit + ` SELECT txid_current(), count(*) FROM gone;
    PERFORM pg_advisory_xact_lock_shared(` + fmt.Sprint(gate) + `);
    RETURN NULL;
END $$`,
		`CREATE TRIGGER audit AFTER DELETE ON "` + table + `" REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION ` + audit + `()`,
	} {
		_, err := db.Exec(stmt)
		require.NoError(t, err)
	}
	return audit
}

func TestSweepRemovesExpiredKeysInBoundedBatchesWhileClaimsSucceed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const batch = 5000

	// The fixture's handler writes the ledger; for the key "inflight_old"
	// it first backdates its own uncommitted claim by 60 days, then waits:
	// a claim in flight that would be expired if it were visible.
	entered, release := make(chan struct{}), make(chan struct{})
	var f *fixture
	f = newPlainFixture(t, idem.Options{HandlerTimeout: 5 * time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k, _ := idem.KeyFromContext(r.Context()); k.EventID == "inflight_old" {
			tx, _ := txFrom(r.Context())
			_, err := tx.ExecContext(r.Context(), `UPDATE "`+f.table+`" SET claimed_at = now() - interval '60 days'
				WHERE source = 'test' AND event_id = 'inflight_old'`)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			close(entered)
			<-release
		}
		f.ledgerHandler().ServeHTTP(w, r)
	}))
	gate := 0x1de0000 + gateSeq.Add(1)
	audit := auditDeletes(t, f.db, f.table, gate)

	insertKeys(t, f.db, f.table, "expired_", 100_000, 40*day)
	insertKeys(t, f.db, f.table, "locked_", 1, 40*day)
	insertKeys(t, f.db, f.table, "young_", 500, 29*day)
	insertKeys(t, f.db, f.table, "fresh_", 500, time.Minute)
	_, err := f.db.Exec(`ANALYZE "` + f.table + `"`)
	require.NoError(t, err)

	// An expired key that another transaction holds locked, and a claim in
	// flight.
	locker, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = locker.Rollback() }()
	_, err = locker.Exec(`SELECT 1 FROM "` + f.table + `" WHERE event_id = 'locked_1' FOR UPDATE`)
	require.NoError(t, err)
	inflight := make(chan reply, 1)
	go func() { inflight <- f.post("inflight_old", "{}") }()
	<-entered

	// Hold the gate: the sweep's first DELETE will wait, its batch deleted
	// but not committed, until it is released. A transaction-level lock,
	// released by COMMIT, so the test also runs through PgBouncer in
	// transaction mode (a session lock could be released on another server
	// connection).
	gateTx, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer gateTx.Rollback() //nolint:errcheck // only ends the gate on a failure path
	_, err = gateTx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, gate)
	require.NoError(t, err)

	type sweepDone struct {
		res idem.SweepResult
		err error
	}
	swept := make(chan sweepDone, 1)
	go func() {
		res, err := idem.Sweep(ctx, f.db, idem.SweepOptions{Table: f.table, BatchSize: batch, MaxBatches: 1000, Pause: -1})
		swept <- sweepDone{res, err}
	}()
	waitForGateWaiter(t, f.db, gate)

	// In the middle of a delete transaction: new keys are claimed and
	// completed, and completed keys are replayed.
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			r := f.post(fmt.Sprintf("new_%d", i), "{}")
			assert.Equal(t, http.StatusCreated, r.status, "a new key mid-sweep: %s", r.body)
		}()
		go func() {
			defer wg.Done()
			r := f.post(fmt.Sprintf("fresh_%d", i+1), "{}")
			assert.Equal(t, http.StatusOK, r.status, "a fresh key mid-sweep: %s", r.body)
			assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
		}()
	}
	wg.Wait()

	// Let the sweep go on, and keep delivering until it is done: new keys,
	// fresh keys, and expired keys (replayed, or claimed anew once swept:
	// both are a success).
	require.NoError(t, gateTx.Commit())
	var (
		done      sweepDone
		finished  = make(chan struct{})
		failures  atomic.Int64
		delivered atomic.Int64
	)
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-finished:
					return
				default:
				}
				n := 1 + (i*7919+w*104729)%500
				id := fmt.Sprintf("new_%d_%d", w, n)
				switch i % 3 {
				case 1:
					id = fmt.Sprintf("fresh_%d", n)
				case 2:
					id = fmt.Sprintf("expired_%d", n)
				}
				delivered.Add(1)
				if r := f.post(id, "{}"); r.status >= 300 {
					failures.Add(1)
					t.Errorf("%s during the sweep: %d %s", id, r.status, r.body)
				}
			}
		}()
	}
	done = <-swept
	close(finished)
	wg.Wait()
	require.NoError(t, done.err)
	assert.Zero(t, failures.Load())
	t.Logf("swept %d keys in %d batches in %v; %d deliveries meanwhile, all answered 2xx",
		done.res.Removed, done.res.Batches, done.res.Duration, delivered.Load())

	assert.Equal(t, int64(100_000), done.res.Removed, "every expired key but the locked one")
	assert.False(t, done.res.Capped)
	assert.Equal(t, 100_000/batch+1, done.res.Batches, "full batches, then one that found nothing")
	var stillExpired int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM "`+f.table+`" WHERE claimed_at < now() - interval '30 days'`).Scan(&stillExpired))
	assert.Equal(t, 1, stillExpired, "only the locked key is left of the expired ones")

	// What the trigger saw: no transaction deleted more than a batch.
	var maxPerTx, total, txs int64
	require.NoError(t, f.db.QueryRow(`SELECT coalesce(max(n), 0), coalesce(sum(n), 0), count(*)
		FROM (SELECT txid, sum(removed) AS n FROM `+audit+` GROUP BY txid) AS per_tx`).Scan(&maxPerTx, &total, &txs))
	assert.LessOrEqual(t, maxPerTx, int64(batch))
	assert.Equal(t, int64(100_000), total)
	assert.GreaterOrEqual(t, txs, int64(100_000/batch))

	assert.Equal(t, 500, countKeys(t, f.db, f.table, "young_"), "keys within the retention stay")
	assert.Equal(t, 500, countKeys(t, f.db, f.table, "fresh_"))
	assert.Equal(t, 1, countKeys(t, f.db, f.table, "locked_"), "a locked key is skipped")
	require.NoError(t, locker.Rollback())

	// The claim in flight was invisible to the sweep: it commits.
	close(release)
	assert.Equal(t, http.StatusCreated, (<-inflight).status)
	assert.Equal(t, 1, countKeys(t, f.db, f.table, "inflight_old"))
}

func TestSweepStopsAtTheBatchCapAndTheNextRunGoesOn(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	table := idem.NewPlainTable(t, db)
	insertKeys(t, db, table, "old_", 25, 31*day)
	opts := idem.SweepOptions{Table: table, BatchSize: 10, MaxBatches: 2, Pause: -1}

	res, err := idem.Sweep(context.Background(), db, opts)
	require.NoError(t, err)
	assert.Equal(t, idem.SweepResult{Removed: 20, Batches: 2, Capped: true}, zeroDuration(res))
	assert.Equal(t, 5, countKeys(t, db, table, "old_"))

	res, err = idem.Sweep(context.Background(), db, opts)
	require.NoError(t, err)
	assert.Equal(t, idem.SweepResult{Removed: 5, Batches: 1}, zeroDuration(res))
	assert.Zero(t, countKeys(t, db, table, "old_"))
}

func zeroDuration(r idem.SweepResult) idem.SweepResult {
	r.Duration = 0
	return r
}

func TestSweepValidatesItsOptions(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	ctx := context.Background()

	t.Run("the default retention is 30 days", func(t *testing.T) {
		table := idem.NewPlainTable(t, db)
		insertKeys(t, db, table, "d29_", 3, 29*day)
		insertKeys(t, db, table, "d31_", 2, 31*day)
		res, err := idem.Sweep(ctx, db, idem.SweepOptions{Table: table, Pause: -1})
		require.NoError(t, err)
		assert.Equal(t, int64(2), res.Removed)
		assert.Equal(t, 3, countKeys(t, db, table, "d29_"))
	})

	t.Run("a retention under 72h is refused, and the error says why", func(t *testing.T) {
		table := idem.NewPlainTable(t, db)
		insertKeys(t, db, table, "k", 1, 71*time.Hour+time.Minute)
		_, err := idem.Sweep(ctx, db, idem.SweepOptions{Table: table, Retention: 71 * time.Hour})
		require.ErrorIs(t, err, idem.ErrUnsafeRetention)
		for _, want := range []string{"71h0m0s", "72h0m0s", "still retries", "twice", "UnsafeShortRetention"} {
			assert.Contains(t, err.Error(), want)
		}
		assert.Equal(t, 1, countKeys(t, db, table, "k"), "nothing deleted")
	})

	t.Run("a short retention is accepted with UnsafeShortRetention", func(t *testing.T) {
		table := idem.NewPlainTable(t, db)
		insertKeys(t, db, table, "h2_", 1, 2*time.Hour)
		insertKeys(t, db, table, "now_", 1, 0)
		res, err := idem.Sweep(ctx, db, idem.SweepOptions{Table: table, Retention: time.Hour, UnsafeShortRetention: true, Pause: -1})
		require.NoError(t, err)
		assert.Equal(t, int64(1), res.Removed)
		assert.Equal(t, 1, countKeys(t, db, table, "now_"))
	})

	for name, opts := range map[string]idem.SweepOptions{
		"a negative retention":            {Retention: -time.Hour, UnsafeShortRetention: true},
		"a negative batch size":           {BatchSize: -1},
		"a batch size over MaxSweepBatch": {BatchSize: idem.MaxSweepBatch + 1},
		"a negative batch cap":            {MaxBatches: -1},
		"an invalid table name":           {Table: "a.b.c"},
	} {
		t.Run(name+" is refused", func(t *testing.T) {
			_, err := idem.Sweep(ctx, db, opts)
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
	db := idem.OpenTestDB(t)
	table := idem.NewPlainTable(t, db)
	insertKeys(t, db, table, "old_", 30, 31*day)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The first batch cancels ctx; the hour-long pause after it must end
	// at once.
	res, err := idem.Sweep(ctx, db, idem.SweepOptions{
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
	res idem.SweepResult
	err error
}

// startSweeper runs RunSweeper in a goroutine; runs receives every run and
// stop cancels it and returns what RunSweeper returned.
func startSweeper(t *testing.T, db *sql.DB, opts idem.SweepOptions, interval time.Duration) (runs <-chan run, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan run)
	opts.Observer = func(r idem.SweepResult, err error) {
		select {
		case ch <- run{r, err}:
		case <-ctx.Done():
		}
	}
	returned := make(chan error, 1)
	go func() { returned <- idem.RunSweeper(ctx, db, opts, interval) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			err = <-returned
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return ch, stop
}

func TestRunSweeperSweepsEveryIntervalUntilCanceled(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	table := idem.NewPlainTable(t, db)
	insertKeys(t, db, table, "first_", 7, 31*day)
	var logs logBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))

	runs, stop := startSweeper(t, db, idem.SweepOptions{Table: table, Pause: -1, Logger: logger}, time.Millisecond)
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
	assert.Equal(t, float64(idem.DefaultRetention), rec["retention"])
	assert.Contains(t, rec, "duration")
}

func TestRunSweeperKeepsGoingAfterAFailedRun(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	var logs logBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))

	runs, stop := startSweeper(t, db, idem.SweepOptions{Table: "no_such_table", Logger: logger}, time.Millisecond)
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
	db := idem.OpenTestDB(t)
	table := idem.NewPlainTable(t, db)
	runs, stop := startSweeper(t, db, idem.SweepOptions{Table: table}, time.Hour)
	require.NoError(t, (<-runs).err)
	require.NoError(t, stop(), "the hour's wait ends with the context")
}

func TestRunSweeperRefusesInvalidSettingsAtOnce(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	err := idem.RunSweeper(context.Background(), db, idem.SweepOptions{}, 0)
	assert.ErrorContains(t, err, "interval")
	err = idem.RunSweeper(context.Background(), db, idem.SweepOptions{Retention: time.Hour}, time.Minute)
	assert.ErrorIs(t, err, idem.ErrUnsafeRetention)
}
