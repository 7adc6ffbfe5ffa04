package idem_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Partitioned tables (docs/partitioning.md), on the suite's adapter,
// whatever IDEM_LAYOUT says. The whole behaviour suite also runs on
// partitioned tables with IDEM_LAYOUT=partitioned.

// newPartitionedFixture is newFixture on a table partitioned by day, with a
// partition for everything before the current day.
func newPartitionedFixture(t testing.TB, opts idem.Options, inner http.Handler) *fixture {
	t.Helper()
	return buildFixture(t, nil, opts, inner, func(t testing.TB, db *sql.DB) string {
		return idem.NewPartitioned(t, db, 24*time.Hour)
	})
}

// insertOld commits a row for the key id, claimed age ago with the body
// "{}", answered 201 `{"old":"<id>"}` unless unanswered.
func (f *fixture) insertOld(id string, age time.Duration, answered bool) {
	f.t.Helper()
	f.insertKey(id, `now() - $5::bigint * interval '1 microsecond'`, age.Microseconds(), answered)
}

// insertKey is insertOld with claimed_at the SQL claimedAt, whose $5 is arg.
func (f *fixture) insertKey(id, claimedAt string, arg any, answered bool) {
	f.t.Helper()
	digest := sha256.Sum256([]byte("{}"))
	status, done := any(201), "now()"
	if !answered {
		status, done = nil, "NULL"
	}
	_, err := f.db.Exec(`INSERT INTO "`+f.table+`" (source, event_id, payload_digest, response_status,
    response_headers, response_body, claimed_at, completed_at)
VALUES ('test', $1, $2, $3, '{"Content-Type": ["application/json"]}', $4, `+claimedAt+`, `+done+`)`,
		id, digest[:], status, fmt.Sprintf(`{"old":%q}`, id), arg)
	require.NoError(f.t, err)
}

// partitionOf names the partition that holds the key id's row.
func (f *fixture) partitionOf(id string) string {
	f.t.Helper()
	var p string
	require.NoError(f.t, f.db.QueryRow(`SELECT tableoid::regclass::text FROM "`+f.table+`" WHERE event_id = $1`, id).Scan(&p))
	return p
}

func TestPartitionedKeyInAnOlderPartitionIsNeverRunAgain(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	f.insertOld("evt_answered", 10*day, true)
	f.insertOld("evt_unanswered", 10*day, false)
	fresh := f.post("evt_new", "{}")
	require.Equal(t, http.StatusCreated, fresh.status)
	assert.NotEqual(t, f.partitionOf("evt_new"), f.partitionOf("evt_answered"), "the old keys sit in an older partition")

	r := f.post("evt_answered", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, `{"old":"evt_answered"}`, string(r.body))
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_answered", `{"other": 1}`).status)
	assert.Equal(t, http.StatusConflict, f.post("evt_unanswered", "{}").status, "committed without an answer")
	assert.Equal(t, int64(1), f.runs.Load(), "only the new key ran")
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, 3, f.keys())
}

// A storm over keys whose rows sit in an older partition and new keys:
// every delivery at once, several times. The old keys never run; each new
// key runs once: with every claim lock-first, and with the past partitions
// summarised, so that the new keys claim on the current partition.
func TestPartitionedStormOverOldAndNewKeys(t *testing.T) {
	t.Parallel()
	for _, summarised := range []bool{false, true} {
		t.Run(fmt.Sprintf("summarised=%v", summarised), func(t *testing.T) {
			t.Parallel()
			stormOverOldAndNewKeys(t, summarised)
		})
	}
}

func stormOverOldAndNewKeys(t *testing.T, summarised bool) {
	const keys, deliveries = 20, 6
	f := newPartitionedFixture(t, idem.Options{LockWait: 10 * time.Second}, nil)
	for i := 0; i < keys; i++ {
		f.insertOld(fmt.Sprintf("old_%d", i), time.Duration(i+1)*day, true)
		f.insertOld(fmt.Sprintf("gone_%d", i), time.Duration(i+1)*day, true)
	}
	s := idem.SummariesOf(f.mw)
	if summarised {
		summarise(t, f)
	} else {
		s.Disable()
	}
	// Keys the summaries hold but no partition does, as a filter's false
	// positives are: new keys, claimed after looking in the past.
	_, err := f.db.Exec(`DELETE FROM "` + f.table + `" WHERE event_id LIKE 'gone_%'`)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[string]map[int]int{}
	start := make(chan struct{})
	for i := 0; i < keys; i++ {
		for _, id := range []string{fmt.Sprintf("old_%d", i), fmt.Sprintf("new_%d", i), fmt.Sprintf("gone_%d", i)} {
			for d := 0; d < deliveries; d++ {
				wg.Add(1)
				go func(id string) {
					defer wg.Done()
					<-start
					r := f.post(id, "{}")
					mu.Lock()
					defer mu.Unlock()
					if statuses[id] == nil {
						statuses[id] = map[int]int{}
					}
					statuses[id][r.status]++
					if strings.HasPrefix(id, "old_") {
						assert.Equal(t, `{"old":"`+id+`"}`, string(r.body))
					}
				}(id)
			}
		}
	}
	close(start)
	wg.Wait()
	for id, s := range statuses {
		for st := range s {
			assert.Contains(t, []int{http.StatusCreated, http.StatusConflict}, st, "%s", id)
		}
		if strings.HasPrefix(id, "old_") {
			assert.Equal(t, deliveries, s[http.StatusCreated], "%s: every delivery replayed", id)
		}
	}
	assert.Equal(t, int64(2*keys), f.runs.Load(), "each new key ran once, no old key ran")
	assert.Equal(t, 2*keys, f.ledgerRows())
	var old int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM `+f.ledger+` WHERE event_id LIKE 'old_%'`).Scan(&old))
	assert.Zero(t, old)
	assert.Equal(t, 3*keys, f.keys(), "one row per key")
	current := f.partitionOf("new_0")
	for i := 0; i < keys; i++ {
		assert.Equal(t, current, f.partitionOf(fmt.Sprintf("gone_%d", i)))
	}
	if summarised {
		assert.GreaterOrEqual(t, s.FastClaims(), int64(keys), "every new key's deliveries claimed on the current partition")
		assert.GreaterOrEqual(t, s.PastAnswers(), int64(keys), "the old keys' answers read in the past partitions")
		assert.GreaterOrEqual(t, s.NarrowClaims(), int64(keys), "the gone keys' claimed after looking there")
	} else {
		assert.Zero(t, s.FastClaims())
	}
}

// A duplicate that waits for an original in flight on another instance
// sees the original's row once it commits, in whichever partition.
func TestPartitionedDuplicateWaitingForAnOriginalFindsItsRowInAnOlderPartition(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{LockWait: time.Minute}, nil)
	ctx := context.Background()
	orig, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer orig.Rollback() //nolint:errcheck // committed below
	_, err = orig.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.LockID(f.table, "test", "evt_1"))
	require.NoError(t, err)
	digest := sha256.Sum256([]byte("{}"))
	_, err = orig.ExecContext(ctx, `INSERT INTO "`+f.table+`" (source, event_id, payload_digest, response_status,
    response_headers, response_body, claimed_at, completed_at)
VALUES ('test', 'evt_1', $1, 201, '{}', 'the original', now() - interval '3 days', now())`, digest[:])
	require.NoError(t, err)

	dup := f.postAsync("evt_1", "{}")
	waitForWaitersOn(t, f, f.mw, "evt_1", 1)
	require.NoError(t, orig.Commit())
	r := <-dup
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, "the original", string(r.body))
	assert.Zero(t, f.runs.Load())
}

// Claims on a partitioned table need READ COMMITTED: a higher level is
// answered 503, and says why.
func TestPartitionedTableRefusesClaimsAboveReadCommitted(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{TxOptions: &sql.TxOptions{Isolation: sql.LevelRepeatableRead}}, nil)
	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusServiceUnavailable, r.status)
	assert.ErrorIs(t, f.observations()[0].Err, idem.ErrPartitionedIsolation)
	assert.Zero(t, f.runs.Load())
	assert.Equal(t, 0, f.keys())
}

func TestMigratePartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := idem.OpenTestDB(t)
	name := fmt.Sprintf("part_%d", time.Now().UnixNano())
	opts := idem.MigrateOptions{Table: name, PartitionInterval: 24 * time.Hour}
	require.NoError(t, idem.MigrateWith(ctx, db, opts))
	partitions := func() []string {
		rows, err := db.Query(`SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) ORDER BY 1`, `"`+name+`"`)
		require.NoError(t, err)
		defer rows.Close()
		var out []string
		for rows.Next() {
			var p string
			require.NoError(t, rows.Scan(&p))
			out = append(out, p)
		}
		require.NoError(t, rows.Err())
		return out
	}
	var today string
	require.NoError(t, db.QueryRow(`SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')`).Scan(&today))
	first := partitions()
	require.Len(t, first, 1+idem.DefaultPartitionsAhead, "the current day's and three ahead")
	assert.Equal(t, name+"_p"+today+"_0000", first[0], "a new table has no past")

	require.NoError(t, idem.MigrateWith(ctx, db, opts), "safe to run again")
	require.NoError(t, idem.Migrate(ctx, db, name), "and without the interval, which the partitions say")
	assert.Equal(t, first, partitions())

	// A partition made ahead of time that went missing comes back; more
	// ahead when asked.
	_, err := db.Exec(`DROP TABLE "` + first[len(first)-1] + `"`)
	require.NoError(t, err)
	require.NoError(t, idem.MigrateWith(ctx, db, idem.MigrateOptions{Table: name, PartitionsAhead: 5}))
	assert.Len(t, partitions(), 6)
	assert.Equal(t, first, partitions()[:4])

	// Each partition has its own primary key; the parent has the index on
	// claimed_at (its partitions too) and no primary key.
	var pkeys, parentKeys, brin int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_constraint c JOIN pg_inherits i ON i.inhrelid = c.conrelid
WHERE i.inhparent = to_regclass($1) AND c.contype = 'p'`, `"`+name+`"`).Scan(&pkeys))
	assert.Equal(t, 6, pkeys)
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_constraint WHERE conrelid = to_regclass($1) AND contype = 'p'`, `"`+name+`"`).Scan(&parentKeys))
	assert.Zero(t, parentKeys)
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid JOIN pg_am a ON a.oid = c.relam
WHERE x.indrelid = to_regclass($1) AND a.amname = 'brin'`, `"`+first[0]+`"`).Scan(&brin))
	assert.Equal(t, 1, brin)

	// A plain table is not converted behind the operator's back.
	plain := idem.NewPlainTable(t, db)
	assert.ErrorContains(t, idem.MigrateWith(ctx, db, idem.MigrateOptions{Table: plain, PartitionInterval: 24 * time.Hour}), "not partitioned")
	for _, bad := range []idem.MigrateOptions{
		{Table: name, PartitionInterval: 30 * time.Minute},
		{Table: name, PartitionInterval: 90 * time.Minute},
		{Table: name, PartitionInterval: -time.Hour},
		{Table: name, PartitionsAhead: -1},
	} {
		assert.Error(t, idem.MigrateWith(ctx, db, bad), "%+v", bad)
	}
}

// The sweep of a partitioned table drops every partition that ended at
// least the retention ago, and no other: not the one that straddles the
// cutoff, which still holds keys inside the retention. It keeps the
// partitions ahead, and claims never wait for it.
func TestPartitionedSweepDropsOnlyPartitionsWhollyOlderThanTheRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGate()
	f := buildFixture(t, nil, idem.Options{HandlerTimeout: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Event-Id") == "evt_held" {
			g.hold()
		}
		w.WriteHeader(http.StatusCreated)
	}), func(t testing.TB, db *sql.DB) string { return idem.NewPartitioned(t, db, time.Hour) })
	// Hourly partitions back to 6 hours before the first one Migrate made
	// (at a), named old<h> for the one that began h hours before a, each
	// with 3 keys 10, 20 and 30 minutes before its end. The table's own
	// partition for the past gives way to them.
	_, err := f.db.Exec(`DROP TABLE "` + f.table + `_p00010101_0000"`)
	require.NoError(t, err)
	var a time.Time
	require.NoError(t, f.db.QueryRow(`SELECT min((regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']*)''\)'))[1]::timestamptz)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)`, `"`+f.table+`"`).Scan(&a))
	for h := 1; h <= 6; h++ {
		_, err := f.db.Exec(fmt.Sprintf(`CREATE TABLE "%[1]s_old%[2]d" (LIKE "%[1]s" INCLUDING DEFAULTS);
ALTER TABLE "%[1]s_old%[2]d" ADD PRIMARY KEY (source, event_id);
ALTER TABLE "%[1]s" ATTACH PARTITION "%[1]s_old%[2]d" FOR VALUES FROM ('%[3]s') TO ('%[4]s')`,
			f.table, h, a.Add(-time.Duration(h)*time.Hour).Format(time.RFC3339), a.Add(-time.Duration(h-1)*time.Hour).Format(time.RFC3339)))
		require.NoError(t, err)
		for k := 1; k <= 3; k++ {
			f.insertKey(fmt.Sprintf("k%d_%d", h, k), `$5::timestamptz`, a.Add(-time.Duration(h-1)*time.Hour-time.Duration(k)*10*time.Minute), true)
		}
		assert.Equal(t, f.table+"_old"+fmt.Sprint(h), f.partitionOf(fmt.Sprintf("k%d_1", h)))
	}
	require.Equal(t, 18, f.keys())

	// Before the sweep, the check counts as overdue the keys of the
	// partitions that ended longer ago than the retention plus the grace:
	// old4 to old6 (ended 3 hours or more before a) for 2h and 1h.
	r, err := idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table, Horizon: time.Hour, Retention: 2 * time.Hour, OverdueGrace: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, int64(9), r.OverdueRows)
	assert.Len(t, r.Partitions, 6+1+idem.DefaultPartitionsAhead)
	assert.Contains(t, checks(r), "overdue_keys")

	// The cutoff: 3h35m before a. old5 and old6 ended before it; old4
	// straddles it, with keys inside the retention.
	var now time.Time
	require.NoError(t, f.db.QueryRow(`SELECT now()`).Scan(&now))
	retention := now.Sub(a) + 3*time.Hour + 35*time.Minute

	// A claim in flight while the sweep runs: the sweep waits for it to
	// end before it drops anything, and claims go on meanwhile.
	held := f.postAsync("evt_held", "{}")
	<-g.entered
	swept := make(chan idemops.SweepResult, 1)
	go func() {
		res, err := idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, Retention: retention, UnsafeShortRetention: true, Pause: -1})
		assert.NoError(t, err)
		swept <- res
	}()
	waitFor(t, "the sweep waiting for the claim in flight", func() bool {
		var n int
		require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
AND query LIKE 'ALTER TABLE%DETACH PARTITION%' AND wait_event_type = 'Lock'`).Scan(&n))
		return n > 0
	})
	assert.Equal(t, http.StatusCreated, f.post("evt_during", "{}").status, "claims do not wait for the sweep")
	g.open()
	assert.Equal(t, http.StatusCreated, (<-held).status)
	res := <-swept

	assert.Equal(t, 2, res.PartitionsDropped)
	assert.Equal(t, int64(6), res.Removed)
	assert.Equal(t, 18-6+2, f.keys())
	for h := 1; h <= 6; h++ {
		var exists bool
		require.NoError(t, f.db.QueryRow(`SELECT to_regclass($1) IS NOT NULL`, fmt.Sprintf(`"%s_old%d"`, f.table, h)).Scan(&exists))
		assert.Equal(t, h <= 4, exists, "old%d", h)
	}
	var inside int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM "`+f.table+`" WHERE event_id LIKE 'k4_%'`).Scan(&inside))
	assert.Equal(t, 3, inside, "the partition that straddles the cutoff keeps its keys")

	// The retention floor applies as on a plain table.
	_, err = idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, Retention: time.Hour})
	assert.ErrorIs(t, err, idemops.ErrUnsafeRetention)
	// Run again: nothing more to drop, the partitions ahead kept.
	res, err = idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, Retention: retention, UnsafeShortRetention: true})
	require.NoError(t, err)
	assert.Zero(t, res.PartitionsDropped)
	r, err = idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table, Horizon: time.Hour, Retention: 5 * time.Hour})
	require.NoError(t, err)
	assert.True(t, r.Partitioned)
	assert.GreaterOrEqual(t, r.PartitionsAhead, idem.DefaultPartitionsAhead)
	assert.NotEmpty(t, r.CurrentPartition)
	assert.Empty(t, r.Findings)
}

// convertSQL is the conversion of docs/partitioning.md for the table t,
// with the cutover cut (a timestamptz literal): first the CHECK constraint
// that lets ATTACH skip its scan, validated without blocking claims; then,
// in one short transaction, the plain table renamed and attached to a new
// partitioned table as its partition for everything before the cutover.
func convertSQL(t, cut string) []string {
	return []string{
		`ALTER TABLE "` + t + `" ADD CONSTRAINT "` + t + `_before_cutover" CHECK (claimed_at < '` + cut + `') NOT VALID`,
		`ALTER TABLE "` + t + `" VALIDATE CONSTRAINT "` + t + `_before_cutover"`,
		`BEGIN`,
		`SET LOCAL lock_timeout = '5s'`,
		`ALTER TABLE "` + t + `" RENAME TO "` + t + `_plain"`,
		`ALTER INDEX "` + t + `_claimed_idx" RENAME TO "` + t + `_plain_claimed_idx"`,
		`CREATE TABLE "` + t + `" (LIKE "` + t + `_plain" INCLUDING DEFAULTS) PARTITION BY RANGE (claimed_at)`,
		`ALTER TABLE "` + t + `" ATTACH PARTITION "` + t + `_plain" FOR VALUES FROM (MINVALUE) TO ('` + cut + `')`,
		`COMMIT`,
	}
}

// A plain table converted by the documented procedure while a middleware
// serves it: its keys keep replaying, new keys run once, and Migrate adds
// the partitions after the cutover.
func TestConvertingAPlainTableToPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newPlainFixture(t, idem.Options{}, nil)
	first := f.post("evt_1", "{}")
	require.Equal(t, http.StatusCreated, first.status)

	var cut string
	require.NoError(t, f.db.QueryRow(`SELECT to_char(date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day', 'YYYY-MM-DD"T00:00:00Z"')`).Scan(&cut))
	conn, err := f.db.Conn(ctx)
	require.NoError(t, err)
	for _, stmt := range convertSQL(f.table, cut) {
		_, err := conn.ExecContext(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	require.NoError(t, conn.Close())
	// An application's Migrate at start, before the operator's: nothing to
	// take an interval from, so nothing added, and no error.
	require.NoError(t, idem.Migrate(ctx, f.db, f.table))
	rep, err := idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table})
	require.NoError(t, err)
	assert.Len(t, rep.Partitions, 1)
	assert.Equal(t, []string{"few_partitions_ahead"}, checks(rep))
	require.NoError(t, idem.MigrateWith(ctx, f.db, idem.MigrateOptions{Table: f.table, PartitionInterval: 24 * time.Hour}))

	r := f.post("evt_1", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, first.body, r.body, "replayed from the old table, now a partition")
	// A database/sql middleware that knew the table as plain finds out
	// with its next claim, and claims lock-first from then on.
	assert.Equal(t, http.StatusCreated, f.post("evt_2", "{}").status)
	assert.Equal(t, http.StatusCreated, f.post("evt_2", "{}").status)
	assert.Equal(t, int64(2), f.runs.Load())
	assert.Equal(t, 2, f.ledgerRows())

	rep, err = idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, f.table+"_plain", rep.CurrentPartition)
	assert.Equal(t, idem.DefaultPartitionsAhead, rep.PartitionsAhead)
	assert.Empty(t, rep.Findings)
	// The old table, now a partition, can still be swept row by row.
	res, err := idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table + "_plain"})
	require.NoError(t, err)
	assert.Zero(t, res.Removed)
}

// Sweeps of one partitioned table that overlap (two CronJob runs, two
// instances running RunSweeper) drop each expired partition once between
// them, and none of them fails.
func TestOverlappingSweepsOfAPartitionedTable(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	_, err := f.db.Exec(`DROP TABLE "` + f.table + `_p00010101_0000"`)
	require.NoError(t, err)
	var a time.Time
	require.NoError(t, f.db.QueryRow(`SELECT date_trunc('day', now())`).Scan(&a))
	for d := 40; d <= 50; d++ {
		_, err := f.db.Exec(fmt.Sprintf(`CREATE TABLE "%[1]s_o%[2]d" (LIKE "%[1]s" INCLUDING DEFAULTS);
ALTER TABLE "%[1]s_o%[2]d" ADD PRIMARY KEY (source, event_id);
ALTER TABLE "%[1]s" ATTACH PARTITION "%[1]s_o%[2]d" FOR VALUES FROM ('%[4]s'::timestamptz - interval '%[2]d days') TO ('%[4]s'::timestamptz - interval '%[3]d days')`, f.table, d, d-1, a.Format(time.RFC3339)))
		require.NoError(t, err)
		f.insertKey(fmt.Sprintf("k%d", d), `$5::timestamptz`, a.Add(-time.Duration(d)*day+time.Hour), true)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var total int64
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := idemops.Sweep(context.Background(), f.db, idemops.SweepOptions{Table: f.table, Pause: -1})
			assert.NoError(t, err)
			mu.Lock()
			total += res.Removed
			mu.Unlock()
		}()
	}
	wg.Wait()
	assert.Equal(t, int64(11), total, "each expired key removed once")
	assert.Equal(t, 0, f.keys())
	var left int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM pg_class WHERE relname LIKE $1`, f.table+"_o%").Scan(&left))
	assert.Zero(t, left, "no partition left detached")
}

// A sweep interrupted while it detached a partition (here: cancelled while
// the detach waited for a reader) leaves the partition pending; the next
// sweep finishes that detach first, and then drops the rest.
func TestSweepFinishesADetachLeftPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	_, err := f.db.Exec(`DROP TABLE "` + f.table + `_p00010101_0000"`)
	require.NoError(t, err)
	var a time.Time
	require.NoError(t, f.db.QueryRow(`SELECT date_trunc('day', now())`).Scan(&a))
	for d := 40; d <= 41; d++ {
		_, err := f.db.Exec(fmt.Sprintf(`CREATE TABLE "%[1]s_o%[2]d" (LIKE "%[1]s" INCLUDING DEFAULTS);
ALTER TABLE "%[1]s_o%[2]d" ADD PRIMARY KEY (source, event_id);
ALTER TABLE "%[1]s" ATTACH PARTITION "%[1]s_o%[2]d" FOR VALUES FROM ('%[4]s'::timestamptz - interval '%[2]d days') TO ('%[4]s'::timestamptz - interval '%[3]d days')`,
			f.table, d, d-1, a.Format(time.RFC3339)))
		require.NoError(t, err)
		f.insertKey(fmt.Sprintf("k%d", d), `$5::timestamptz`, a.Add(-time.Duration(d)*day+time.Hour), true)
	}

	// A reader holds the table; the detach of o41 waits for it and is
	// cancelled, which leaves o41 pending.
	reader, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = reader.Rollback() }) // lets a stuck detach go on if the test fails early
	_, err = reader.ExecContext(ctx, `SELECT count(*) FROM "`+f.table+`"`)
	require.NoError(t, err)
	detach := `ALTER TABLE "` + f.table + `" DETACH PARTITION "` + f.table + `_o41" CONCURRENTLY`
	detached := make(chan error, 1)
	go func() {
		_, err := f.db.ExecContext(ctx, detach)
		detached <- err
	}()
	// The detach's backend, found by its statement: through PgBouncer in
	// transaction mode, a client connection's backend can change between
	// statements, so pg_backend_pid() asked beforehand could name another.
	var pid int
	waitFor(t, "the detach waiting for the reader", func() bool {
		err := f.db.QueryRow(`SELECT pid FROM pg_stat_activity WHERE query = $1 AND wait_event_type = 'Lock'`, detach).Scan(&pid)
		if errors.Is(err, sql.ErrNoRows) {
			return false
		}
		require.NoError(t, err)
		return true
	})
	_, err = f.db.Exec(`SELECT pg_cancel_backend($1)`, pid)
	require.NoError(t, err)
	require.Error(t, <-detached)
	require.NoError(t, reader.Rollback())
	var pending bool
	require.NoError(t, f.db.QueryRow(`SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass`, `"`+f.table+`_o41"`).Scan(&pending))
	require.True(t, pending, "the cancelled detach left the partition pending")

	res, err := idemops.Sweep(ctx, f.db, idemops.SweepOptions{Table: f.table, Pause: -1})
	require.NoError(t, err)
	assert.Equal(t, 2, res.PartitionsDropped)
	assert.Equal(t, int64(2), res.Removed)
	assert.Equal(t, 0, f.keys())
}
