// Package testdb gives each test a PostgreSQL database of its own, created
// with a random name and dropped when the test ends, so tests can run in
// parallel, and next to other test runs, without seeing each other's rows.
//
// The server is the one at DATABASE_URL, by default the local one
// (postgres@127.0.0.1:5432, trust auth). A test that needs it fails, never
// skips, when it is not there.
package testdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net/url"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/pgidem/idem/examples/internal/example"
)

// URL creates a fresh, empty database and returns its URL. The database is
// dropped, with any connection still open to it, when t ends.
func URL(t testing.TB) string {
	t.Helper()
	admin := example.DatabaseURL()
	u, err := url.Parse(admin)
	if err != nil || u.Scheme == "" {
		t.Fatalf("DATABASE_URL must be a postgres:// URL for the tests, got %q", admin)
	}
	adminDB, err := sql.Open("pgx", admin)
	if err != nil {
		t.Fatal(err)
	}
	defer adminDB.Close()

	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idem_examples_" + hex.EncodeToString(b[:])
	if _, err := adminDB.ExecContext(context.Background(), "CREATE DATABASE "+name); err != nil {
		t.Fatalf("PostgreSQL is required: cannot create a test database through %s (start one, or set DATABASE_URL): %v", u.Redacted(), err)
	}
	t.Cleanup(func() {
		db, err := sql.Open("pgx", admin)
		if err != nil {
			t.Error(err)
			return
		}
		defer db.Close()
		if _, err := db.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop test database %s: %v", name, err)
		}
	})
	u.Path = "/" + name
	return u.String()
}

// Open creates a fresh database (see URL) and returns a connection pool on
// it, closed when t ends, before the database is dropped.
func Open(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", URL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := db.PingContext(context.Background()); err != nil {
		t.Fatalf("PostgreSQL is required: %v", err)
	}
	return db
}
