package idemops

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"go.uber.org/goleak"
)

// Where the tests of the operations are: here, those that need only the
// database (keys written straight into a table, partitions dated back).
// Those that run Check, Stats and Sweep against the claims of a live
// middleware (held in flight, or in a storm) are in the root package's
// health_test.go, sweep_test.go, sweepstorm_test.go and partition_test.go,
// whose fixture the root's suite runs on both adapters and both layouts.
//
// Like the root's tests, these create one database of their own per test
// binary (dropped at the end) and one table per test inside it, and fail,
// never skip, when PostgreSQL is not there. IDEM_LAYOUT=partitioned makes
// newTable create partitioned tables.

var (
	dbOnce sync.Once
	dbURL  string
	dbName string
	dbErr  error
)

func TestMain(m *testing.M) {
	if os.Getenv("IDEM_TEST_LOG") == "" { // a nil SweepOptions.Logger logs to slog.Default()
		slog.SetDefault(slog.New(slog.DiscardHandler))
	}
	code := m.Run()
	if dbName != "" {
		if err := testdb.Drop(dbName); err != nil {
			fmt.Fprintln(os.Stderr, "idemops tests: drop test database:", err)
		}
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemops tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// databaseURL returns the URL of this test binary's own database.
func databaseURL(t testing.TB) string {
	t.Helper()
	dbOnce.Do(func() { dbURL, dbName, dbErr = testdb.Create("idemops_test") })
	if dbErr != nil {
		t.Fatalf("PostgreSQL is required: %v", dbErr)
	}
	return dbURL
}

// openDB opens a pool on the test database, closed when t ends.
func openDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", databaseURL(t))
	return testdb.Ready(t, db, err)
}

// The tests' tables (testdb.Tables): newTable in the suite's layout
// (IDEM_LAYOUT), newPlainTable plain whatever it says,
// newPartitionedTable partitioned by interval.
var (
	tables              = testdb.Tables{Prefix: "ops", Migrate: migrateTable}
	newTable            = tables.New
	newPlainTable       = tables.Plain
	newPartitionedTable = tables.Partitioned
)

// migrateTable is idem.MigrateWith, for testdb.Tables.
func migrateTable(ctx context.Context, db *sql.DB, name string, interval time.Duration) error {
	return idem.MigrateWith(ctx, db, idem.MigrateOptions{Table: name, PartitionInterval: interval})
}

const day = 24 * time.Hour

var (
	insertKeys = testdb.InsertKeys
	countKeys  = testdb.CountKeys
	waitFor    = testdb.WaitFor
	newRole    = testdb.NewRole
)

type logBuffer = testdb.LogBuffer
