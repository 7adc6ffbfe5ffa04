// Package testdb creates and drops the throwaway databases that the tests
// and runnable examples of this module use, on the server at DATABASE_URL
// (default: the local server, postgres@127.0.0.1:5432, trust auth). Tests
// only: the library never imports it.
package testdb

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/pgidem/idem/internal/catalog"
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

// AddPastPartition adds a partition from MINVALUE to the lowest partition
// of the partitioned table name, for keys dated back.
func AddPastPartition(ctx context.Context, db *sql.DB, name string) error {
	tbl, err := catalog.ParseTable(name)
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	parts, err := catalog.ListPartitions(ctx, tx, tbl)
	if err != nil {
		return err
	}
	if len(parts) == 0 || parts[0].From.IsZero() {
		return fmt.Errorf("table %s: no partitions, or one from MINVALUE already", name)
	}
	if err := catalog.CreatePartition(ctx, tx, tbl, time.Time{}, parts[0].From); err != nil {
		return err
	}
	return tx.Commit()
}
