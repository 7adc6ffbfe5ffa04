// Package migration carries what a migration did from package idem, which
// migrates, to the idem command, which says it: created the table, added
// what an older table lacked, or found it up to date. Nothing here is
// public API: Go's internal rule keeps it to this module.
package migration

import (
	"context"
	"database/sql"
)

// Result is what one migration did.
type Result struct {
	// Created: the table did not exist, and the migration created it with
	// its index.
	Created bool
	// Partitioned: the table is partitioned (created so, or found so).
	Partitioned bool
	// ColumnsAdded and IndexesAdded count what the migration added to a
	// table that existed (an older table: the lease-mode columns, the
	// claimed_at index).
	ColumnsAdded, IndexesAdded int
	// PartitionsCreated counts the partitions it created, on a partitioned
	// table: on a new one, the current partition and those ahead.
	PartitionsCreated int
}

// Run is idem.MigrateWith returning what it did; opts is an
// idem.MigrateOptions. Filled in by package idem when it is initialized,
// so a program that calls it imports package idem.
var Run func(ctx context.Context, db *sql.DB, opts any) (Result, error)
