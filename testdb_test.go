package idem

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/testdb"
	"go.uber.org/goleak"
)

// The tests need PostgreSQL: they create one database of their own per test
// binary (dropped at the end) and one table per test inside it, so parallel
// tests and concurrent runs never see each other's keys. A test that needs
// the database fails, never skips, when the server is not there.

var (
	testDBOnce sync.Once
	testDBURL  string
	testDBName string
	testDBErr  error
	tableSeq   atomic.Int64
)

func TestMain(m *testing.M) {
	switch a := os.Getenv("IDEM_ADAPTER"); a {
	case "", "sql", "pgx":
	default:
		fmt.Fprintln(os.Stderr, "idem tests: IDEM_ADAPTER must be sql or pgx, not", a)
		os.Exit(2)
	}
	switch l := os.Getenv("IDEM_LAYOUT"); l {
	case "", "plain", "partitioned":
	default:
		fmt.Fprintln(os.Stderr, "idem tests: IDEM_LAYOUT must be plain or partitioned, not", l)
		os.Exit(2)
	}
	// A nil Options.Logger logs to slog.Default(): keep the suite's
	// thousands of refusals out of its output unless asked for.
	if os.Getenv("IDEM_TEST_LOG") == "" {
		slog.SetDefault(slog.New(slog.DiscardHandler))
	}
	// The runnable Examples open os.Getenv("DATABASE_URL"), as an
	// application does: point it at this binary's own database.
	testDBOnce.Do(func() { testDBURL, testDBName, testDBErr = createTestDatabase() })
	admin, hadAdmin := os.LookupEnv("DATABASE_URL")
	if testDBErr == nil {
		os.Setenv("DATABASE_URL", testDBURL)
	}
	code := m.Run()
	if hadAdmin { // testdb drops the database through the server's admin URL
		os.Setenv("DATABASE_URL", admin)
	} else {
		os.Unsetenv("DATABASE_URL")
	}
	if testDBName != "" {
		if err := dropTestDatabase(); err != nil {
			fmt.Fprintln(os.Stderr, "idem tests: drop test database:", err)
		}
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idem tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func createTestDatabase() (string, string, error) { return testdb.Create("idem_test") }

func dropTestDatabase() error { return testdb.Drop(testDBName) }

// testDatabaseURL returns the URL of this test binary's own database.
func testDatabaseURL(t testing.TB) string {
	t.Helper()
	testDBOnce.Do(func() { testDBURL, testDBName, testDBErr = createTestDatabase() })
	if testDBErr != nil {
		t.Fatalf("PostgreSQL is required: %v", testDBErr)
	}
	return testDBURL
}

// dsns maps each *sql.DB the tests open to its DSN, so that the pgx pass
// can open a pgx pool on the same database.
var dsns sync.Map

// openDSN opens a pool on dsn and records its DSN.
func openDSN(dsn string) (*sql.DB, error) {
	db, err := sql.Open("pgx", dsn)
	if err == nil {
		dsns.Store(db, dsn)
	}
	return db, err
}

// dsnOf returns the DSN a test opened db with.
func dsnOf(db *sql.DB) (string, bool) {
	v, ok := dsns.Load(db)
	if !ok {
		return "", false
	}
	return v.(string), true
}

// openTestDB opens a pool on the test database, closed when t ends.
func openTestDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := openDSN(testDatabaseURL(t))
	return testdb.Ready(t, db, err)
}

// The suite's tables (testdb.Tables): newTestTable in the suite's layout
// (IDEM_LAYOUT), newPlainTestTable plain whatever it says (for the tests of
// the row-by-row sweep), newPartitionedTestTable partitioned by interval.
var (
	tables                  = testdb.Tables{Prefix: "idem", Migrate: migrateTable}
	partitionedLayout       = testdb.PartitionedLayout
	newTestTable            = tables.New
	newPlainTestTable       = tables.Plain
	newPartitionedTestTable = tables.Partitioned
)

// migrateTable is MigrateWith, for testdb.Tables.
func migrateTable(ctx context.Context, db *sql.DB, name string, interval time.Duration) error {
	return MigrateWith(ctx, db, MigrateOptions{Table: name, PartitionInterval: interval})
}
