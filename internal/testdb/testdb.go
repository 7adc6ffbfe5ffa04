// Package testdb creates and drops the throwaway databases that the tests
// and runnable examples of this module use, on the server at DATABASE_URL
// (default: the local server, postgres@127.0.0.1:5432, trust auth). Tests
// only: the library never imports it.
package testdb

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// DefaultURL is the server the tests use when DATABASE_URL is not set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// AdminURL is DATABASE_URL, or DefaultURL.
func AdminURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Create creates a database named prefix_<random> and returns its URL and
// name. The error says how to start PostgreSQL when it is not there.
func Create(prefix string) (dbURL, name string, err error) {
	admin, err := sql.Open("pgx", AdminURL())
	if err != nil {
		return "", "", err
	}
	defer admin.Close()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name = prefix + "_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		return "", "", fmt.Errorf("cannot create a test database through DATABASE_URL=%s (is PostgreSQL running? see README): %w", AdminURL(), err)
	}
	u, err := url.Parse(AdminURL())
	if err != nil {
		return "", "", err
	}
	u.Path = "/" + name
	return u.String(), name, nil
}

// Drop drops the database name, closing its sessions.
func Drop(name string) error {
	admin, err := sql.Open("pgx", AdminURL())
	if err != nil {
		return err
	}
	defer admin.Close()
	_, err = admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)")
	return err
}
