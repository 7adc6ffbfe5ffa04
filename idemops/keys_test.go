package idemops

import (
	"bytes"
	"context"
	"database/sql"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/catalog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The keys' functions on both layouts, each key put in its state the way
// it gets there: completed, in flight and leased keys by a live middleware
// whose handler is held; unanswered keys and expired leases, which need a
// misbehaving handler or a crashed instance, written straight into the
// table.

// layouts runs f as a subtest on a plain table and on a table partitioned
// by day (with a partition for the past, so keys can be dated back).
func layouts(t *testing.T, f func(t *testing.T, db *sql.DB, table string)) {
	for _, l := range []struct {
		name     string
		interval time.Duration
	}{{"on a plain table", 0}, {"on a partitioned table", day}} {
		t.Run(l.name, func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			f(t, db, newPartitionedTable(t, db, l.interval))
		})
	}
}

// heldClaim is a delivery whose handler is running and waits for release.
type heldClaim struct {
	release chan struct{}
	done    chan int // the delivery's status
	once    sync.Once
	code    int
}

// hold delivers event id of source "test" through a middleware on table
// (lease mode when lease > 0) and returns once its handler runs.
func hold(t *testing.T, db *sql.DB, table, id string, lease time.Duration) *heldClaim {
	t.Helper()
	entered := make(chan struct{})
	h := &heldClaim{release: make(chan struct{}), done: make(chan int, 1)}
	opts := idem.Options{Table: table, KeyFunc: idem.Header("test", "X-Event-Id"), Lease: lease,
		Logger: slog.New(slog.DiscardHandler)}
	if lease > 0 {
		opts.HandlerTimeout = lease / 2
	}
	mw, err := idem.New(db, opts)
	require.NoError(t, err)
	handler := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-h.release
		w.WriteHeader(http.StatusAccepted)
	}))
	go func() {
		req := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader(`{}`))
		req.Header.Set("X-Event-Id", id)
		rec := httptest.NewRecorder()
		handler.ServeHTTP(rec, req)
		h.done <- rec.Code
	}()
	select {
	case <-entered:
	case code := <-h.done:
		t.Fatalf("the delivery of %s ended with %d before its handler ran", id, code)
	}
	t.Cleanup(func() { h.finish() })
	return h
}

// finish lets the handler return and waits for the delivery's status.
func (h *heldClaim) finish() int {
	h.once.Do(func() {
		close(h.release)
		h.code = <-h.done
	})
	return h.code
}

// insertRow commits a key of source "test" without an answer, claimed an
// hour ago, with the lease given as SQL ("NULL", "now() + ...").
func insertRow(t *testing.T, db *sql.DB, table, id, leaseUntil string) {
	t.Helper()
	_, err := db.Exec(`INSERT INTO "`+table+`" (source, event_id, payload_digest, claimed_at, lease_until, lease_token)
VALUES ('test', $1, sha256('{}'::bytea), now() - interval '1 hour', `+leaseUntil+`, CASE WHEN `+leaseUntil+` IS NULL THEN NULL ELSE 7 END)`, id)
	require.NoError(t, err)
}

func key(id string) idem.Key { return idem.Key{Source: "test", EventID: id} }

func TestShowKeyInEachState(t *testing.T) {
	t.Parallel()
	layouts(t, func(t *testing.T, db *sql.DB, table string) {
		ctx := context.Background()
		insertKeys(t, db, table, "done_", 1, 2*day)
		insertRow(t, db, table, "unanswered", "NULL")
		insertRow(t, db, table, "expired", "now() - interval '1 minute'")
		leased := hold(t, db, table, "leased", time.Minute)
		inFlight := hold(t, db, table, "in_flight", 0)

		show := func(id string, body bool) *KeyInfo {
			t.Helper()
			k, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key(id), Body: body})
			require.NoError(t, err, id)
			assert.Equal(t, key(id), k.Key)
			assert.False(t, k.CheckedAt.IsZero())
			return k
		}

		t.Run("a completed key shows its answer, and its body only when asked", func(t *testing.T) {
			k := show("done_1", false)
			assert.Equal(t, KeyCompleted, k.State)
			assert.Equal(t, 200, k.Status)
			assert.Equal(t, http.Header{"Content-Type": {"text/plain"}}, k.Headers)
			assert.Equal(t, 2, k.BodySize)
			assert.Nil(t, k.Body, "no body unless asked")
			assert.Equal(t, "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", k.PayloadDigest, "sha256 of {}")
			assert.InDelta(t, float64(2*day), float64(k.CheckedAt.Sub(k.ClaimedAt)), float64(time.Minute))
			assert.False(t, k.CompletedAt.IsZero())
			assert.False(t, k.InFlight)
			if k.Partition != "" {
				assert.Contains(t, k.Partition, table+"_p", "the partition that holds it")
			}
			assert.Equal(t, []byte("ok"), show("done_1", true).Body)
		})
		t.Run("an unanswered key", func(t *testing.T) {
			k := show("unanswered", false)
			assert.Equal(t, KeyUnanswered, k.State)
			assert.Zero(t, k.Status)
			assert.True(t, k.CompletedAt.IsZero())
			assert.True(t, k.LeaseUntil.IsZero())
		})
		t.Run("a lease that ran out", func(t *testing.T) {
			k := show("expired", false)
			assert.Equal(t, KeyLeaseExpired, k.State)
			assert.True(t, k.LeaseUntil.Before(k.CheckedAt))
		})
		t.Run("a live lease, with its end", func(t *testing.T) {
			k := show("leased", false)
			assert.Equal(t, KeyLeased, k.State)
			assert.InDelta(t, float64(time.Minute), float64(k.LeaseUntil.Sub(k.CheckedAt)), float64(10*time.Second))
		})
		t.Run("a claim in flight has no row but its session", func(t *testing.T) {
			k := show("in_flight", false)
			assert.Equal(t, KeyInFlight, k.State)
			assert.True(t, k.InFlight)
			assert.Positive(t, k.HolderPID)
			assert.True(t, k.ClaimedAt.IsZero())
		})
		t.Run("a key never seen is not found", func(t *testing.T) {
			_, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key("never")})
			assert.ErrorIs(t, err, ErrKeyNotFound)
			_, err = ShowKey(ctx, db, KeyOptions{Table: table, Key: idem.Key{Source: "other", EventID: "done_1"}})
			assert.ErrorIs(t, err, ErrKeyNotFound, "the same id of another source")
		})
		t.Run("once the claim commits, the key is completed", func(t *testing.T) {
			assert.Equal(t, http.StatusAccepted, inFlight.finish())
			assert.Equal(t, http.StatusAccepted, leased.finish())
			for _, id := range []string{"in_flight", "leased"} {
				k := show(id, true)
				assert.Equal(t, KeyCompleted, k.State, id)
				assert.Equal(t, http.StatusAccepted, k.Status)
				assert.False(t, k.InFlight)
				assert.Empty(t, k.Body)
			}
		})
	})
}

func TestListKeysByState(t *testing.T) {
	t.Parallel()
	layouts(t, func(t *testing.T, db *sql.DB, table string) {
		ctx := context.Background()
		insertKeys(t, db, table, "old_", 3, 3*day)
		insertKeys(t, db, table, "new_", 3, time.Minute)
		insertRow(t, db, table, "unanswered", "NULL")
		insertRow(t, db, table, "expired", "now() - interval '1 minute'")
		insertRow(t, db, table, "leased", "now() + interval '1 minute'")
		_, err := db.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, claimed_at, completed_at, response_status)
VALUES ('other', 'x', '\x00', now() - interval '2 minutes', now(), 204)`)
		require.NoError(t, err)

		ids := func(opts ListOptions) []string {
			t.Helper()
			opts.Table = table
			keys, err := ListKeys(ctx, db, opts)
			require.NoError(t, err)
			var out []string
			for _, k := range keys {
				out = append(out, k.Key.EventID)
			}
			return out
		}
		// Newest first: new_ keys a minute ago (new_3 the newest), x two
		// minutes ago, the three without an answer an hour ago (the last
		// inserted first), old_ keys three days ago.
		assert.Equal(t, []string{"new_3", "new_2", "new_1", "x", "leased", "expired", "unanswered", "old_3", "old_2", "old_1"}, ids(ListOptions{}))
		assert.Equal(t, []string{"unanswered"}, ids(ListOptions{State: ListUnanswered}))
		assert.Equal(t, []string{"expired", "unanswered"}, ids(ListOptions{State: ListStuck}))
		assert.Equal(t, []string{"leased"}, ids(ListOptions{State: ListLeased}))
		assert.Equal(t, []string{"expired"}, ids(ListOptions{State: ListExpired}))
		assert.Equal(t, []string{"x"}, ids(ListOptions{Source: "other"}))
		assert.Equal(t, []string{"new_3", "new_2"}, ids(ListOptions{Limit: 2}))
		assert.Equal(t, []string{"new_3", "new_2", "new_1", "x"}, ids(ListOptions{Since: time.Now().Add(-10 * time.Minute)}))
		assert.Equal(t, []string{"old_3", "old_2"}, ids(ListOptions{Before: time.Now().Add(-2 * day), Limit: 2}))

		_, err = ListKeys(ctx, db, ListOptions{Table: table, State: "done"})
		assert.ErrorContains(t, err, `unknown state "done"`)
		_, err = ListKeys(ctx, db, ListOptions{Table: table, Limit: MaxListLimit + 1})
		assert.Error(t, err)
	})
}

func TestForgetKey(t *testing.T) {
	t.Parallel()
	layouts(t, func(t *testing.T, db *sql.DB, table string) {
		ctx := context.Background()
		var logs bytes.Buffer
		var mu sync.Mutex
		logger := slog.New(slog.NewJSONHandler(&lockedWriter{&mu, &logs}, nil))
		forget := func(id string, force bool) (*Forgotten, error) {
			return ForgetKey(ctx, db, ForgetOptions{Table: table, Key: key(id), Force: force,
				Actor: "alice", Reason: "INC-42", Logger: logger, LockTimeout: time.Second})
		}
		gone := func(id string) bool {
			_, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key(id)})
			return err != nil && assert.ErrorIs(t, err, ErrKeyNotFound)
		}

		t.Run("a completed key is deleted, and its next delivery runs the handler", func(t *testing.T) {
			insertKeys(t, db, table, "done_", 1, day)
			f, err := forget("done_1", false)
			require.NoError(t, err)
			assert.Equal(t, KeyCompleted, f.State)
			assert.Equal(t, 200, f.Status)
			assert.False(t, f.Forced)
			assert.True(t, gone("done_1"))
			h := hold(t, db, table, "done_1", 0) // runs the handler again
			assert.Equal(t, http.StatusAccepted, h.finish())

			mu.Lock()
			line := logs.String()
			mu.Unlock()
			assert.Contains(t, line, `"msg":"idem: key forgotten"`)
			assert.Contains(t, line, `"event_id":"done_1"`)
			assert.Contains(t, line, `"actor":"alice"`)
			assert.Contains(t, line, `"reason":"INC-42"`)
			assert.Contains(t, line, `"state":"completed"`)
			assert.Contains(t, line, `"level":"WARN"`)
		})
		t.Run("unanswered keys and expired leases are deleted without force", func(t *testing.T) {
			insertRow(t, db, table, "unanswered", "NULL")
			insertRow(t, db, table, "expired", "now() - interval '1 minute'")
			for id, state := range map[string]KeyState{"unanswered": KeyUnanswered, "expired": KeyLeaseExpired} {
				f, err := forget(id, false)
				require.NoError(t, err, id)
				assert.Equal(t, state, f.State)
				assert.True(t, gone(id))
			}
		})
		t.Run("a live lease is refused, then forced", func(t *testing.T) {
			h := hold(t, db, table, "leased", time.Minute)
			_, err := forget("leased", false)
			require.ErrorIs(t, err, ErrLeaseLive)
			assert.Contains(t, err.Error(), "force")
			k, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key("leased")})
			require.NoError(t, err)
			assert.Equal(t, KeyLeased, k.State, "still there")

			f, err := forget("leased", true)
			require.NoError(t, err)
			assert.True(t, f.Forced)
			assert.Equal(t, KeyLeased, f.State)
			assert.True(t, gone("leased"))
			// The original finishes after the delete: its lease is gone,
			// so it stores nothing.
			h.finish()
			assert.True(t, gone("leased"), "the fenced original stored no answer")
		})
		t.Run("a claim in flight is refused, forced or not: it has no row yet", func(t *testing.T) {
			h := hold(t, db, table, "in_flight", 0)
			for _, force := range []bool{false, true} {
				_, err := forget("in_flight", force)
				assert.ErrorIs(t, err, ErrKeyInFlight)
			}
			assert.Equal(t, http.StatusAccepted, h.finish())
			k, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key("in_flight")})
			require.NoError(t, err)
			assert.Equal(t, KeyCompleted, k.State, "the claim committed as if nothing happened")
		})
		t.Run("a committed key whose lock a session holds is refused, then forced", func(t *testing.T) {
			insertKeys(t, db, table, "locked_", 1, time.Hour)
			conn, err := db.Conn(ctx)
			require.NoError(t, err)
			defer conn.Close()
			tx, err := conn.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			_, err = tx.Exec(`SELECT pg_advisory_xact_lock($1)`, lockID(table, key("locked_1")))
			require.NoError(t, err)

			_, err = forget("locked_1", false)
			require.ErrorIs(t, err, ErrKeyInFlight)
			k, err := ShowKey(ctx, db, KeyOptions{Table: table, Key: key("locked_1")})
			require.NoError(t, err)
			assert.True(t, k.InFlight)
			assert.Equal(t, KeyCompleted, k.State)

			f, err := forget("locked_1", true)
			require.NoError(t, err)
			assert.True(t, f.Forced)
			assert.True(t, f.InFlight)
			k, err = ShowKey(ctx, db, KeyOptions{Table: table, Key: key("locked_1")})
			require.NoError(t, err)
			assert.Equal(t, KeyInFlight, k.State, "no row, and its lock still held")
			require.NoError(t, tx.Rollback())
			assert.True(t, gone("locked_1"))
		})
		t.Run("a key never seen is not found", func(t *testing.T) {
			_, err := forget("never", false)
			assert.ErrorIs(t, err, ErrKeyNotFound)
			_, err = forget("never", true)
			assert.ErrorIs(t, err, ErrKeyNotFound)
		})
	})
}

func TestKeysOfAMissingTable(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	ctx := context.Background()
	_, err := ShowKey(ctx, db, KeyOptions{Table: "no_such_table", Key: key("x")})
	assert.ErrorContains(t, err, "does not exist")
	_, err = ListKeys(ctx, db, ListOptions{Table: "no_such_table"})
	assert.ErrorContains(t, err, "does not exist")
	_, err = ForgetKey(ctx, db, ForgetOptions{Table: "no_such_table", Key: key("x")})
	assert.ErrorContains(t, err, "does not exist")
	_, err = ShowKey(ctx, db, KeyOptions{Table: "Bad Name", Key: key("x")})
	assert.Error(t, err)
}

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// lockID is the key's advisory lock in table, as the middleware takes it.
func lockID(table string, k idem.Key) int64 { return catalog.LockID(table, k.Source, k.EventID) }

func TestFindKeysAcrossSources(t *testing.T) {
	t.Parallel()
	layouts(t, func(t *testing.T, db *sql.DB, table string) {
		insertKeys(t, db, table, "evt_", 3, time.Minute)
		_, err := db.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, claimed_at)
SELECT 's' || g, CASE WHEN g % 2 = 0 THEN 'evt_2' ELSE 'other' END, '\x00', now() - g * interval '1 second'
FROM generate_series(1, 9) AS g`)
		require.NoError(t, err)
		keys, err := FindKeys(context.Background(), db, table, "evt_2")
		require.NoError(t, err)
		var got []string
		for _, k := range keys {
			got = append(got, k.Key.Source)
		}
		assert.Equal(t, []string{"s2", "s4", "s6", "s8", "test"}, got, "newest first")
		keys, err = FindKeys(context.Background(), db, table, "nothing")
		require.NoError(t, err)
		assert.Empty(t, keys)
	})
}
