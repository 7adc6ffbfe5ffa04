package connecttest

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
)

// createDatabase creates a database named prefix_<random> on the server at
// DATABASE_URL (default: the local server, postgres@127.0.0.1:5432, trust
// auth) and returns its URL and a function that drops it. This module's
// tests cannot use the root module's internal/testdb, and should not: a
// module's tests depend only on what its users can import.
func createDatabase(prefix string) (dbURL string, drop func() error, err error) {
	server := os.Getenv("DATABASE_URL")
	if server == "" {
		server = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	u, err := url.Parse(server)
	if err != nil {
		return "", nil, err
	}
	admin, err := sql.Open("pgx", server)
	if err != nil {
		return "", nil, err
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := prefix + "_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		admin.Close()
		return "", nil, fmt.Errorf("cannot create a test database through DATABASE_URL=%s (is PostgreSQL running?): %w", server, err)
	}
	u.Path = "/" + name
	return u.String(), func() error {
		defer admin.Close()
		_, err := admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)")
		return err
	}, nil
}
