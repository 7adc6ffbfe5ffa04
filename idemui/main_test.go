package idemui_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The tests run against a PostgreSQL database of their own (created here,
// dropped at the end), one table per test, and fail, never skip, when
// PostgreSQL is not there.

var (
	db       *sql.DB
	tableSeq atomic.Int64
)

func TestMain(m *testing.M) {
	slog.SetDefault(slog.New(slog.DiscardHandler))
	u, drop, err := createDatabase("idemui_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemui tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemui tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemui tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// newTable migrates a fresh table, partitioned by day when partitioned,
// and fills it with one key in each state, all claimed within the last
// minute (so that a partitioned table's current partition holds them):
//
//	stripe/evt_done       completed 200, body {"ok":true}
//	github/evt_done       completed 202: the same event id, another source
//	stripe/evt_unanswered committed without an answer
//	stripe/evt_expired    lease ran out
//	stripe/evt_leased     lease live for an hour
//	evil/<script>alert(1)</script>  completed 200, its source and body hostile too
func newTable(t testing.TB, partitioned bool) string {
	t.Helper()
	name := fmt.Sprintf("ui_%d", tableSeq.Add(1))
	opts := idem.MigrateOptions{Table: name}
	if partitioned {
		opts.PartitionInterval = 24 * time.Hour
	}
	require.NoError(t, idem.MigrateWith(context.Background(), db, opts))
	_, err := db.Exec(`INSERT INTO "` + name + `" (source, event_id, payload_digest, response_status, response_headers, response_body,
    claimed_at, completed_at, lease_until, lease_token) VALUES
('stripe', 'evt_done', sha256('{}'::bytea), 200, '{"Content-Type": ["application/json"]}', '{"ok":true}', now() - interval '50 seconds', now() - interval '49.9 seconds', NULL, NULL),
('github', 'evt_done', '\x00', 202, '{}', '', now() - interval '40 seconds', now() - interval '39 seconds', NULL, NULL),
('stripe', 'evt_unanswered', '\x00', NULL, NULL, NULL, now() - interval '30 seconds', NULL, NULL, NULL),
('stripe', 'evt_expired', '\x00', NULL, NULL, NULL, now() - interval '20 seconds', NULL, now() - interval '1 second', 1),
('stripe', 'evt_leased', '\x00', NULL, NULL, NULL, now() - interval '10 seconds', NULL, now() + interval '1 hour', 2),
('<b>evil</b>', '<script>alert(1)</script>', '\x00', 200, '{"X-Evil": ["<img src=x onerror=alert(2)>"]}', '<script>alert(3)</script>', now() - interval '5 seconds', now(), NULL, NULL)`)
	require.NoError(t, err)
	return name
}
