package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const day = 24 * time.Hour

// insertKeys and countKeys write and count keys straight in a table
// (testdb.InsertKeys, testdb.CountKeys).
var (
	insertKeys = testdb.InsertKeys
	countKeys  = testdb.CountKeys
)

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
		res idemops.SweepResult
		err error
	}
	swept := make(chan sweepDone, 1)
	go func() {
		res, err := idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, BatchSize: batch, MaxBatches: 1000, Pause: -1})
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
