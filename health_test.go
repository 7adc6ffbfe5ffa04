package idem_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// finding returns the report's finding of the named check, failing the test
// when there is none; every finding must say what happened and what to do.
func finding(t *testing.T, r *idemops.Report, check string) idemops.Finding {
	t.Helper()
	for _, f := range r.Findings {
		if f.Check == check {
			assert.NotEmpty(t, f.What)
			assert.NotEmpty(t, f.Action)
			return f
		}
	}
	t.Fatalf("no %s finding in %+v", check, r.Findings)
	return idemops.Finding{}
}

func checks(r *idemops.Report) []string {
	var out []string
	for _, f := range r.Findings {
		out = append(out, f.Check)
	}
	return out
}

// holdClaim starts a delivery of eventID through f whose handler waits
// until the returned release is called; it returns once the claim is in
// flight, with the claim's backend pid. release returns the answer.
func holdClaim(t *testing.T, opts idem.Options, eventID string) (f *fixture, pid int, release func() reply) {
	t.Helper()
	entered, done := make(chan int), make(chan struct{})
	f = newFixture(t, opts, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		var pid int
		if err := tx.QueryRowContext(r.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		entered <- pid
		<-done
		w.WriteHeader(http.StatusNoContent)
	}))
	answer := make(chan reply, 1)
	go func() { answer <- f.post(eventID, "{}") }()
	pid = <-entered
	var once bool
	release = func() reply {
		if !once {
			once = true
			close(done)
		}
		return <-answer
	}
	t.Cleanup(func() {
		if !once {
			release()
		}
	})
	return f, pid, release
}

func TestCheckFindsKeysCommittedWithoutAnAnswer(t *testing.T) {
	t.Parallel()
	// A handler that commits the middleware's transaction itself leaves
	// its claim committed without an answer.
	f := newFixture(t, idem.Options{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_ = tx.Commit()
		_, _ = w.Write([]byte("ok"))
	}))
	if onPgx {
		// idempgx's transaction cannot be committed by the handler: make
		// the row such a handler leaves behind with database/sql.
		_, err := f.db.Exec(`INSERT INTO "` + f.table + `" (source, event_id, payload_digest) VALUES ('test', 'evt_misused', sha256('{}'))`)
		require.NoError(t, err)
	} else {
		require.Equal(t, http.StatusInternalServerError, f.post("evt_misused", "{}").status)
	}
	require.Equal(t, http.StatusConflict, f.post("evt_misused", "{}").status, "it answers 409 from now on")

	r, err := idemops.Check(context.Background(), f.db, idemops.CheckOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, idemops.SeverityCritical, r.Severity())
	fd := finding(t, r, "unanswered_keys")
	assert.Equal(t, idemops.SeverityCritical, fd.Severity)
	assert.Contains(t, fd.What, `"evt_misused"`)
	assert.Contains(t, fd.What, "409")
	assert.Equal(t, int64(1), r.Unanswered)
	require.Len(t, r.UnansweredKeys, 1)
	assert.Equal(t, idem.Key{Source: "test", EventID: "evt_misused"}, r.UnansweredKeys[0].Key)
	assert.Equal(t, []string{"unanswered_keys"}, checks(r))
}

func TestCheckFindsClaimsStuckInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f, pid, release := holdClaim(t, idem.Options{HandlerTimeout: 5 * time.Minute}, "evt_slow")

	// Neither a transaction that only holds an advisory lock nor one that
	// only writes to the table (as a sweep does) is a claim.
	locker, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = locker.Rollback() }()
	_, err = locker.Exec(`SELECT pg_advisory_xact_lock($1)`, 0x1de0000+gateSeq.Add(1))
	require.NoError(t, err)
	writer, err := f.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = writer.Rollback() }()
	_, err = writer.Exec(`DELETE FROM "` + f.table + `" WHERE false`)
	require.NoError(t, err)

	// The claim began before this check did, so it is older than 1ns.
	r, err := idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table, StuckAfter: time.Nanosecond})
	require.NoError(t, err)
	assert.Equal(t, 1, r.InFlight)
	require.Len(t, r.Stuck, 1)
	c := r.Stuck[0]
	assert.Equal(t, pid, c.PID)
	assert.Equal(t, "idle in transaction", c.State)
	assert.Positive(t, c.Age)
	assert.False(t, c.XactStart.IsZero())
	assert.Equal(t, idemops.SeverityCritical, finding(t, r, "stuck_claims").Severity)
	assert.Equal(t, []string{"stuck_claims"}, checks(r))

	// Under the threshold it is in flight, not stuck.
	r, err = idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table, StuckAfter: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, 1, r.InFlight)
	assert.Empty(t, r.Stuck)
	assert.Empty(t, r.Findings)

	assert.Equal(t, http.StatusNoContent, release().status)
	r, err = idemops.Check(ctx, f.db, idemops.CheckOptions{Table: f.table, StuckAfter: time.Nanosecond})
	require.NoError(t, err)
	assert.Zero(t, r.InFlight)
}

func TestCheckSaysWhenItCannotSeeTheClaims(t *testing.T) {
	t.Parallel()
	f, _, release := holdClaim(t, idem.Options{HandlerTimeout: 5 * time.Minute}, "evt_hidden")

	// A role without pg_read_all_stats sees other roles' sessions, but not
	// when their transactions began.
	var b [4]byte
	_, _ = rand.Read(b[:])
	role := "idem_check_" + hex.EncodeToString(b[:])
	_, err := f.db.Exec(`CREATE ROLE ` + role + ` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = f.db.Exec(`DROP OWNED BY ` + role)
		_, _ = f.db.Exec(`DROP ROLE ` + role)
	})
	_, err = f.db.Exec(`GRANT SELECT ON "` + f.table + `" TO ` + role)
	require.NoError(t, err)
	u, err := url.Parse(idem.TestDatabaseURL(t))
	require.NoError(t, err)
	u.User = url.User(role)
	limited, err := sql.Open("pgx", u.String())
	require.NoError(t, err)
	defer limited.Close()

	r, err := idemops.Check(context.Background(), limited, idemops.CheckOptions{Table: f.table, StuckAfter: time.Nanosecond})
	require.NoError(t, err)
	assert.Equal(t, 1, r.InFlight)
	assert.Equal(t, 1, r.Invisible)
	assert.Empty(t, r.Stuck)
	fd := finding(t, r, "claims_not_visible")
	assert.Equal(t, idemops.SeverityWarning, fd.Severity)
	assert.Contains(t, fd.Action, "pg_read_all_stats")
	release()
}

func TestStatsCountsKeysBySource(t *testing.T) {
	t.Parallel()
	f, _, release := holdClaim(t, idem.Options{HandlerTimeout: 5 * time.Minute}, "evt_in_flight")
	_, err := f.db.Exec(`INSERT INTO "` + f.table + `" (source, event_id, payload_digest, response_status, claimed_at, completed_at)
SELECT s, s || g, '\x00', CASE WHEN g = 4 THEN NULL ELSE 200 END, now() - g * interval '1 hour',
       CASE WHEN g = 4 THEN NULL ELSE now() END
FROM (VALUES ('alpha', 4), ('beta', 2), ('gamma', 1)) AS v(s, n), generate_series(1, n) AS g`)
	require.NoError(t, err)

	s, err := idemops.Stats(context.Background(), f.db, idemops.StatsOptions{Table: f.table, MaxSources: 2})
	require.NoError(t, err)
	assert.Equal(t, f.table, s.Table)
	assert.Equal(t, int64(7), s.Rows)
	assert.Equal(t, int64(6), s.Completed)
	assert.Equal(t, int64(1), s.Unanswered)
	assert.Equal(t, 1, s.InFlight, "the claim in flight is counted, though its key is invisible")
	assert.Positive(t, s.TableBytes)
	require.Len(t, s.Sources, 2)
	assert.Equal(t, 1, s.OtherSources)
	a := s.Sources[0]
	assert.Equal(t, "alpha", a.Source)
	assert.Equal(t, int64(3), a.Completed)
	assert.Equal(t, int64(1), a.Unanswered)
	assert.Equal(t, 3*time.Hour, a.Newest.Sub(a.Oldest), "one now() for the whole insert")
	assert.Equal(t, "beta", s.Sources[1].Source)
	assert.Equal(t, s.Sources[0].Oldest, s.Oldest)
	assert.Equal(t, http.StatusNoContent, release().status)

	all, err := idemops.Stats(context.Background(), f.db, idemops.StatsOptions{Table: f.table})
	require.NoError(t, err)
	assert.Len(t, all.Sources, 4, "the released claim committed, in source \"test\"")
	assert.Zero(t, all.OtherSources)
	assert.Zero(t, all.InFlight)
	assert.Equal(t, int64(8), all.Rows)
}
