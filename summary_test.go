package idem_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/internal/summary"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Summaries of the past partitions of a partitioned table
// (docs/partitioning.md): a claim whose key they rule out claims on the
// current partition as on a plain table; any other claims lock-first across
// the partitions.

// awaitSummaries refreshes s until every past partition is summarised: until
// the transactions that were running when each partition had ended (by
// its margin) have ended too.
func awaitSummaries(t testing.TB, s *summary.Summaries) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for !s.Ready() {
		require.NoError(t, s.Refresh(ctx))
	}
}

// summarise reads the summaries of the past partitions of f's table, with
// a margin of a second (the current partition may have begun less than a
// minute ago), and returns them.
func summarise(t testing.TB, f *fixture) *summary.Summaries {
	t.Helper()
	s := idem.SummariesOf(f.mw)
	s.Set(time.Second, 10*time.Second, 2*time.Second)
	awaitSummaries(t, s)
	return s
}

func TestSummariesLetNewKeysClaimOnTheCurrentPartition(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	f.insertOld("evt_old", 10*day, true)
	f.insertOld("evt_old_unanswered", 10*day, false)
	s := summarise(t, f)

	r := f.post("evt_new", "{}")
	require.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, int64(1), s.FastClaims(), "a key no past partition holds claims on the current one")
	current := f.partitionOf("evt_new")
	assert.NotEqual(t, f.partitionOf("evt_old"), current)

	r = f.post("evt_old", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, `{"old":"evt_old"}`, string(r.body), "replayed from the past partition")
	assert.Equal(t, http.StatusUnprocessableEntity, f.post("evt_old", `{"other": 1}`).status)
	assert.Equal(t, http.StatusConflict, f.post("evt_old_unanswered", "{}").status)
	assert.Equal(t, int64(1), s.FastClaims(), "the past partition's summary does not rule those keys out")
	assert.Equal(t, int64(1), s.PastAnswers(), "the answer read in that partition, without a transaction (the 422 came from the replay cache)")
	assert.Equal(t, int64(1), s.NarrowClaims(), "the key without an answer claimed after looking in that partition")

	again := f.post("evt_new", "{}")
	assert.Equal(t, http.StatusCreated, again.status)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, int64(2), s.FastClaims(), "a replay from the current partition is fast too")
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 1, f.ledgerRows())
	assert.Equal(t, 3, f.keys())
}

// In lease mode too, a key answered in a past partition is replayed from
// there, and a new key claims as ever.
func TestSummariesAnswerLeaseModeFromThePast(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{Lease: 10 * time.Second}, nil)
	f.insertOld("evt_old", 10*day, true)
	s := summarise(t, f)

	r := f.post("evt_old", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, `{"old":"evt_old"}`, string(r.body))
	assert.Equal(t, int64(1), s.PastAnswers())
	require.Equal(t, http.StatusCreated, f.post("evt_new", "{}").status)
	assert.Equal(t, int64(1), f.runs.Load())
	assert.Equal(t, 2, f.keys())
}

// A row of a past partition that holds no answer is no answer: the claim
// reads the key's row and lock again, and a lease-mode row whose lease ran
// out is taken over (moving to the current partition), one still running
// is in flight.
func TestSummariesPastRowsWithoutAnAnswerAreLookedUpUnderTheLock(t *testing.T) {
	t.Parallel()
	f := newPartitionedFixture(t, idem.Options{}, nil)
	for id, until := range map[string]string{"evt_crashed": "now() - interval '1 hour'", "evt_running": "now() + interval '1 hour'"} {
		f.insertOld(id, 10*day, false)
		_, err := f.db.Exec(`UPDATE "`+f.table+`" SET lease_until = `+until+`, lease_token = 7 WHERE event_id = $1`, id)
		require.NoError(t, err)
	}
	s := summarise(t, f)

	assert.Equal(t, http.StatusConflict, f.post("evt_running", "{}").status)
	r := f.post("evt_crashed", "{}")
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	assert.Equal(t, int64(1), f.runs.Load())
	// Both claimed after looking in the past partition, never on the
	// current one alone. At least two: a claim made again after a
	// serialization failure or a deadlock asks the summaries again (seen
	// once in CI, with the whole suite running on both adapters at once).
	narrow := s.NarrowClaims()
	assert.GreaterOrEqual(t, narrow, int64(2))
	assert.Zero(t, s.FastClaims())
	require.Equal(t, http.StatusCreated, f.post("evt_new", "{}").status)
	assert.Equal(t, narrow, s.NarrowClaims(), "a new key does not look in the past partition")
	assert.Equal(t, f.partitionOf("evt_new"), f.partitionOf("evt_crashed"), "taken over: dated by the takeover")
	var done bool
	require.NoError(t, f.db.QueryRow(`SELECT completed_at IS NOT NULL FROM "`+f.table+`" WHERE event_id = 'evt_crashed'`).Scan(&done))
	assert.True(t, done)
	assert.Equal(t, 3, f.keys())
}

// A transaction that began before a partition's end can still write a key
// into it after the end: the partition is summarised only once every
// transaction running a margin after its end has ended. Without that wait
// the summary would miss the key, and its redelivery would run again.
func TestSummariesWaitForTransactionsBegunBeforeAPartitionEnded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var table string
	boundary := dbClock(t).Truncate(time.Second).Add(2 * time.Second)
	f := buildFixture(t, nil, idem.Options{}, nil, func(t testing.TB, db *sql.DB) string {
		table = newEdgeTable(t, db, boundary)
		return table
	})
	db := f.db

	// A delivery whose transaction began before the boundary, and has not
	// written its key yet.
	late, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer late.Rollback() //nolint:errcheck // committed below
	var began time.Time
	require.NoError(t, late.QueryRowContext(ctx, `SELECT now()`).Scan(&began))
	require.True(t, began.Before(boundary))

	s := idem.SummariesOf(f.mw)
	const margin = 500 * time.Millisecond
	s.Set(margin, 10*time.Second, 100*time.Millisecond)
	// The clock must pass the boundary (and the margin): nothing else
	// marks that time.
	_, err = db.Exec(`SELECT pg_sleep_until($1)`, boundary.Add(margin))
	require.NoError(t, err)
	require.NoError(t, s.Refresh(ctx))
	assert.False(t, s.Ready(), "a transaction begun before the boundary still runs")

	digest := sha256.Sum256([]byte("{}"))
	_, err = late.ExecContext(ctx, `INSERT INTO "`+table+`" (source, event_id, payload_digest, response_status,
    response_headers, response_body, completed_at)
VALUES ('test', 'evt_late', $1, 201, '{}', 'the late original', now())`, digest[:])
	require.NoError(t, err)
	require.NoError(t, late.Commit())
	assert.Equal(t, table+"_p0", f.partitionOf("evt_late"), "dated by its transaction's start")

	awaitSummaries(t, s)
	r := f.post("evt_late", "{}")
	assert.Equal(t, http.StatusCreated, r.status)
	assert.Equal(t, "the late original", string(r.body))
	assert.Zero(t, f.runs.Load(), "the redelivery replays")
	assert.Zero(t, s.FastClaims())
	assert.Equal(t, int64(1), s.PastAnswers())

	require.Equal(t, http.StatusCreated, f.post("evt_new", "{}").status)
	assert.Equal(t, int64(1), s.FastClaims())
	assert.Equal(t, table+"_p1", f.partitionOf("evt_new"))
}

// dbClock is the database's clock.
func dbClock(t testing.TB) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, idem.OpenTestDB(t).QueryRow(`SELECT clock_timestamp()`).Scan(&now))
	return now
}

// newEdgeTable makes a table partitioned at the times bounds: <table>_p0
// from MINVALUE to the first, <table>_p1 to the second and so on, the last
// for a day.
func newEdgeTable(t testing.TB, db *sql.DB, bounds ...time.Time) string {
	t.Helper()
	plain := idem.NewPlainTable(t, db)
	table := plain + "_edge"
	at := func(t time.Time) string { return `'` + t.Format(time.RFC3339Nano) + `'` }
	stmts := []string{`CREATE TABLE "` + table + `" (LIKE "` + plain + `" INCLUDING DEFAULTS) PARTITION BY RANGE (claimed_at)`}
	from := "MINVALUE"
	for i, b := range append(bounds, bounds[len(bounds)-1].Add(day)) {
		stmts = append(stmts, fmt.Sprintf(`CREATE TABLE "%s_p%d" PARTITION OF "%s" (PRIMARY KEY (source, event_id))
    FOR VALUES FROM (%s) TO (%s)`, table, i, table, from, at(b)))
		from = at(b)
	}
	for _, stmt := range stmts {
		_, err := db.Exec(stmt)
		require.NoError(t, err, stmt)
	}
	return table
}

// A claim that Fast sends to the current partition but whose transaction
// begins after that partition's end (here: the instance's clock runs 10
// seconds behind the database's across a boundary) is refused there before
// any handler runs, and claims again lock-first across every partition:
// its row goes to the partition of its time.
func TestSummariesClaimBegunPastTheBoundaryClaimsLockFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const margin = 200 * time.Millisecond
	var (
		f        *fixture
		s        *summary.Summaries
		table    string
		boundary time.Time
	)
	// Until the summaries are read before the boundary, on a busy machine.
	for lead := 2 * time.Second; ; lead *= 2 {
		boundary = dbClock(t).Truncate(time.Second).Add(lead)
		f = buildFixture(t, nil, idem.Options{}, nil, func(t testing.TB, db *sql.DB) string {
			table = newEdgeTable(t, db, boundary.Add(-time.Hour), boundary)
			return table
		})
		s = idem.SummariesOf(f.mw)
		s.Set(margin, time.Hour, 100*time.Millisecond) // no listing after the first
		f.insertKey("evt_gone", "$5::timestamptz", boundary.Add(-2*time.Hour), true)
		awaitSummaries(t, s)
		if dbClock(t).Before(boundary.Add(-margin)) {
			break
		}
		require.Less(t, lead, 30*time.Second, "the summaries were never read before the boundary")
	}
	// The clock must pass the boundary: nothing else marks that time.
	_, err := f.db.ExecContext(ctx, `SELECT pg_sleep_until($1)`, boundary.Add(margin))
	require.NoError(t, err)
	s.Skew(boundary.Add(-10 * time.Second).Sub(dbClock(t)))

	for i, id := range []string{"evt_1", "evt_2"} {
		r := f.post(id, "{}")
		assert.Equal(t, http.StatusCreated, r.status, "%s", r.body)
		assert.Equal(t, table+"_p2", f.partitionOf(id), "the partition of its transaction's time")
		assert.Equal(t, int64(i+1), s.FastClaims(), "sent to the partition it turned out not to be in")
	}
	// A key the first partition's summary holds, but no partition does (a
	// false positive): claimed after looking in the past, and refused too.
	_, err = f.db.Exec(`DELETE FROM "` + table + `" WHERE event_id = 'evt_gone'`)
	require.NoError(t, err)
	r := f.post("evt_gone", "{}")
	assert.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	assert.Equal(t, table+"_p2", f.partitionOf("evt_gone"))
	assert.Equal(t, int64(1), s.NarrowClaims())
	assert.Equal(t, int64(3), f.runs.Load())
	assert.Equal(t, 3, f.ledgerRows())
}

// A claim on the current partition alone (the summaries rule the key out of
// the past ones) locks that partition, not the partitioned table: check
// still counts it in flight.
func TestCheckSeesAClaimOnTheCurrentPartition(t *testing.T) {
	t.Parallel()
	entered, done := make(chan struct{}), make(chan struct{})
	f := newPartitionedFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-done
		w.WriteHeader(http.StatusNoContent)
	}))
	s := summarise(t, f)
	answered := make(chan int, 1)
	go func() { answered <- f.post("evt_now", "{}").status }()
	<-entered
	require.Equal(t, int64(1), s.FastClaims(), "the key is claimed on the current partition")
	r, err := idemops.Check(context.Background(), f.db, idemops.CheckOptions{Table: f.table, StuckAfter: time.Nanosecond})
	close(done)
	require.NoError(t, err)
	assert.Equal(t, 1, r.InFlight)
	assert.Len(t, r.Stuck, 1)
	assert.Equal(t, http.StatusNoContent, <-answered)
}
