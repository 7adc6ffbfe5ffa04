package idem

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/claims"
	"github.com/pgidem/idem/internal/driver"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The snapshot trap on a partitioned table, with two connections in a fixed
// order: an original holds the key's lock, with its row (dated into an
// older partition) inserted but not committed; a duplicate comes and waits
// for the lock; the original commits. The claim looks for the key with a
// statement sent after the lock is held, which sees the row: a replay. The
// same claim with the lock taken inside the statement that looks for the
// key (its snapshot is taken before the wait) does not see the row, and
// runs the handler a second time: this test fails on such a claim.
func TestPartitionedClaimLooksForTheKeyAfterTakingTheLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		oneStatement bool
		runs         int64
		rows         int
	}{
		{"the lock, then a new statement looks for the key", false, 0, 1},
		{"the lock taken by the statement that looks for the key", true, 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := openTestDB(t)
			name := newPartitionedTestTable(t, db, 24*time.Hour)
			tbl, err := parseTable(name)
			require.NoError(t, err)
			key := Key{Source: "test", EventID: "evt_old"}
			lock := tbl.lockID(key)
			var runs atomic.Int64
			q := driver.NewQueries(tbl.Quoted)
			if tc.oneStatement {
				// A claim that takes the key's lock (waiting) in the
				// statement that looks for the key and inserts it.
				q.TryLock = `SELECT $1::bigint IS NOT NULL`
				q.ClaimOrRead = strings.Replace(q.ClaimOrRead, "WITH r AS MATERIALIZED (",
					fmt.Sprintf("WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(%d)),\nr AS MATERIALIZED (", lock), 1)
				q.ClaimOrRead = strings.Replace(q.ClaimOrRead, "FROM "+q.Table+" AS k WHERE", "FROM "+q.Table+" AS k, l WHERE", 1)
			}
			mw, err := newMiddleware(sqlPool{db}, Options{KeyFunc: Header("test", "X-Event-Id"), Table: name, LockWait: time.Minute})
			require.NoError(t, err)
			mw.drv, err = claims.New(sqlPool{db}, q, nil)
			require.NoError(t, err)
			h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write([]byte("second run"))
			}))

			// The original: the key's lock and its row, uncommitted.
			orig, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer orig.Rollback() //nolint:errcheck // committed below
			_, err = orig.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, lock)
			require.NoError(t, err)
			digest := sha256.Sum256([]byte("{}"))
			_, err = orig.ExecContext(ctx, `INSERT INTO `+tbl.Quoted+` (source, event_id, payload_digest,
    response_status, response_headers, response_body, claimed_at, completed_at)
VALUES ($1, $2, $3, 201, '{}', 'first run', now() - interval '10 days', now())`, key.Source, key.EventID, digest[:])
			require.NoError(t, err)

			// The duplicate, until it waits for the key's lock.
			answered := make(chan *httptest.ResponseRecorder)
			go func() {
				req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader("{}"))
				req.Header.Set("X-Event-Id", key.EventID)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				answered <- rec
			}()
			deadline := time.Now().Add(30 * time.Second)
			for {
				var waiting int
				require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid = $1::bigint::oid AND objid = $2::bigint::oid`, int64(uint64(lock)>>32), int64(uint64(lock)&0xffffffff)).Scan(&waiting))
				if waiting > 0 {
					break
				}
				require.True(t, time.Now().Before(deadline), "the duplicate never waited for the key's lock")
				time.Sleep(2 * time.Millisecond)
			}
			require.NoError(t, orig.Commit())

			rec := <-answered
			assert.Equal(t, tc.runs, runs.Load(), "handler runs of the duplicate")
			var rows int
			require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+tbl.Quoted+` WHERE event_id = $1`, key.EventID).Scan(&rows))
			assert.Equal(t, tc.rows, rows, "rows of the key")
			assert.Equal(t, http.StatusCreated, rec.Code)
			if !tc.oneStatement {
				assert.Equal(t, "first run", rec.Body.String(), "the original's answer, replayed")
				assert.Equal(t, "true", rec.Header().Get("Idempotent-Replayed"))
			}
		})
	}
}

// A new event's answer, on a partitioned table, is stored by an UPDATE of
// the one partition its claim went to, not by one that looks for the key in
// every partition (which doubled a new event's work there): the claim dates
// the row now(), the transaction's start, and the UPDATE asks for that, so
// PostgreSQL leaves the other partitions out when the statement starts.
func TestPartitionedAnswerUpdatesOnePartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openTestDB(t)
	name := newPartitionedTestTable(t, db, 24*time.Hour)
	tbl, err := parseTable(name)
	require.NoError(t, err)
	q := driver.NewQueries(tbl.Quoted)

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	parts, err := catalog.ListPartitions(ctx, tx, tbl.Table)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(parts), 5, "the past, the current partition and 3 ahead")

	d, err := claims.New(sqlPool{db}, q, nil)
	require.NoError(t, err)
	key := Key{Source: "test", EventID: "evt_new"}
	a := &driver.Args{Source: key.Source, EventID: key.EventID, Digest: make([]byte, 32), Lock: tbl.lockID(key)}
	b, err := d.Begin(ctx, a)
	require.NoError(t, err)
	defer func() { _ = b.Tx.Rollback(ctx) }()
	require.True(t, b.Won)
	c := b.Tx.Handle().(*sql.Tx)

	// The statement the adapter sends, run by EXPLAIN ANALYZE in the
	// claim's transaction: the row is updated, and every other partition
	// was removed from the plan when it started.
	_, err = c.ExecContext(ctx, "PREPARE complete_claimed(text, text, smallint, jsonb, bytea) AS "+q.CompleteClaimedNow)
	require.NoError(t, err)
	var plan string
	require.NoError(t, c.QueryRowContext(ctx,
		`EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF, FORMAT JSON) EXECUTE complete_claimed('test', 'evt_new', 201, NULL, 'ok')`).Scan(&plan))
	assert.True(t, strings.Contains(plan, fmt.Sprintf(`"Subplans Removed": %d`, len(parts)-1)),
		"the answer's UPDATE did not leave the other %d partitions out", len(parts)-1)
	var status int
	require.NoError(t, c.QueryRowContext(ctx, "SELECT response_status FROM "+tbl.Quoted+" WHERE event_id = 'evt_new'").Scan(&status))
	assert.Equal(t, 201, status)
}
