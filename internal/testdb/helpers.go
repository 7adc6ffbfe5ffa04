package testdb

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The helpers that the tests of package idem and of package idemops share:
// keys written straight into a table, polling, a log sink.

// InsertKeys commits n completed keys "<prefix><i>" of source "test",
// claimed age ago (plus i milliseconds, in insertion order, as real claims
// are), in one statement. Their stored answer is 200 "ok" for the body
// "{}", so deliveries of them through a middleware are replayed.
func InsertKeys(t testing.TB, db *sql.DB, table, prefix string, n int, age time.Duration) {
	t.Helper()
	_, err := db.Exec(`INSERT INTO "`+table+`" (source, event_id, payload_digest,
    response_status, response_headers, response_body, claimed_at, completed_at)
SELECT 'test', $1 || g, sha256('{}'::bytea), 200, '{"Content-Type": ["text/plain"]}', 'ok', c, c
FROM generate_series(1, $2::int) AS g,
     LATERAL (SELECT now() - $3::bigint * interval '1 microsecond' + g * interval '1 millisecond') AS x(c)`,
		prefix, n, age.Microseconds())
	if err != nil {
		t.Fatal(err)
	}
}

// CountKeys counts the committed keys whose event id starts with prefix.
func CountKeys(t testing.TB, db *sql.DB, table, prefix string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM "`+table+`" WHERE starts_with(event_id, $1)`, prefix).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// WaitFor polls cond until it holds, failing the test after 30 seconds.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// LogBuffer is an io.Writer for slog handlers that tests read while
// goroutines still log.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *LogBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *LogBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// NewRole creates a superuser login role with the ALTER ROLE setting
// given (e.g. "SET lock_timeout = '7s'"), dropped when t ends.
func NewRole(t testing.TB, admin *sql.DB, setting string) string {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	role := "idem_role_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(`CREATE ROLE ` + role + ` LOGIN SUPERUSER`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '` + role + `'`)
		_, _ = admin.Exec(`DROP ROLE ` + role)
	})
	if _, err := admin.Exec(`ALTER ROLE ` + role + ` ` + setting); err != nil {
		t.Fatal(err)
	}
	return role
}

// Ready finishes opening a test binary's pool (the result of sql.Open, or
// of a wrapper that records its DSN): it caps it at 20 connections, all
// kept idle (database/sql keeps 2 by default, and concurrent tests would
// reconnect all the time), closes it when t ends, and fails t when the
// server is not there.
func Ready(t testing.TB, db *sql.DB, err error) *sql.DB {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(20)
	db.SetMaxIdleConns(20)
	t.Cleanup(func() { db.Close() })
	if err := db.PingContext(context.Background()); err != nil {
		t.Fatalf("PostgreSQL is required: %v", err)
	}
	return db
}

// MigrateFunc creates the idempotency table name: plain when interval is
// 0, else partitioned by interval (idem.MigrateWith, which this package
// cannot import).
type MigrateFunc func(ctx context.Context, db *sql.DB, name string, interval time.Duration) error

// PartitionedLayout: IDEM_LAYOUT=partitioned makes Tables.New create
// partitioned tables, so that a suite runs on that layout too
// (scripts/test.sh runs it once so).
var PartitionedLayout = os.Getenv("IDEM_LAYOUT") == "partitioned"

// Tables makes one fresh idempotency table per test, named
// <Prefix>_<n>, with Migrate.
type Tables struct {
	Prefix  string
	Migrate MigrateFunc
	seq     atomic.Int64
}

// New migrates a fresh table in the suite's layout (IDEM_LAYOUT): plain,
// or partitioned by day with a partition for everything before the
// current day, so that tests can date keys back.
func (ts *Tables) New(t testing.TB, db *sql.DB) string {
	t.Helper()
	if PartitionedLayout {
		return ts.Partitioned(t, db, 24*time.Hour)
	}
	return ts.Plain(t, db)
}

// Plain migrates a fresh plain table, whatever IDEM_LAYOUT says.
func (ts *Tables) Plain(t testing.TB, db *sql.DB) string {
	t.Helper()
	return ts.Partitioned(t, db, 0)
}

// Partitioned migrates a fresh table partitioned by interval (plain when
// interval is 0), with a partition for everything before the current one.
func (ts *Tables) Partitioned(t testing.TB, db *sql.DB, interval time.Duration) string {
	t.Helper()
	name := fmt.Sprintf("%s_%d", ts.Prefix, ts.seq.Add(1))
	ctx := context.Background()
	if err := ts.Migrate(ctx, db, name, interval); err != nil {
		t.Fatal(err)
	}
	if interval > 0 {
		if err := AddPastPartition(ctx, db, name); err != nil {
			t.Fatal(err)
		}
	}
	return name
}
