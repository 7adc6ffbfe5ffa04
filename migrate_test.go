package idem

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/migration"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Long table names: PostgreSQL cuts identifiers to 63 bytes, so an index
// name derived by cutting could be the table's own name (found by the
// reliability tests: the index was quietly not created) or the index of
// another table with the same long prefix.
func TestMigrateCreatesTheIndexForLongTableNames(t *testing.T) {
	t.Parallel()
	db := openTestDB(t)
	ctx := context.Background()
	long := strings.Repeat("t", 55)
	for _, name := range []string{
		"m_" + strings.Repeat("a", 50),
		"m_" + strings.Repeat("b", 60),
		"m_" + strings.Repeat("c", 61), // 63 bytes
		"m_" + long + "_one",
		"m_" + long + "_two", // same first 60 bytes as the one before
		"m_no_such_schema.x", // the schema does not exist: refused below
	} {
		if strings.Contains(name, ".") {
			assert.ErrorContains(t, Migrate(ctx, db, name), "does not exist", "the schema must exist")
			continue
		}
		require.NoError(t, Migrate(ctx, db, name))
		require.NoError(t, Migrate(ctx, db, name), "safe to run twice")
		var indexes int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1)`, catalog.QuoteIdent(name)).Scan(&indexes))
		assert.Equal(t, 2, indexes, "%s (%d bytes): the primary key and the claimed_at index", name, len(name))
		tbl, err := parseTable(name)
		require.NoError(t, err)
		assert.LessOrEqual(t, len(tbl.Index), 63+2, "quoted")
	}
}

// The migration reports what it did, for the idem command to say it.
func TestMigrateReportsWhatItDid(t *testing.T) {
	t.Parallel()
	db := openTestDB(t)
	ctx := context.Background()
	name := fmt.Sprintf("m_report_%d", tableSeq.Add(1))
	res, err := migrate(ctx, db, MigrateOptions{Table: name})
	require.NoError(t, err)
	assert.Equal(t, migration.Result{Created: true}, res)
	res, err = migrate(ctx, db, MigrateOptions{Table: name})
	require.NoError(t, err)
	assert.Equal(t, migration.Result{}, res, "up to date")

	tbl, err := parseTable(name)
	require.NoError(t, err)
	_, err = db.Exec(`ALTER TABLE ` + name + ` DROP COLUMN lease_token; DROP INDEX ` + tbl.Index)
	require.NoError(t, err)
	res, err = migrate(ctx, db, MigrateOptions{Table: name})
	require.NoError(t, err)
	assert.Equal(t, migration.Result{ColumnsAdded: 1, IndexesAdded: 1}, res)

	part := name + "_p"
	res, err = migration.Run(ctx, db, MigrateOptions{Table: part, PartitionInterval: 24 * time.Hour, PartitionsAhead: 2})
	require.NoError(t, err)
	assert.Equal(t, migration.Result{Created: true, Partitioned: true, PartitionsCreated: 3}, res)
	res, err = migration.Run(ctx, db, MigrateOptions{Table: part, PartitionsAhead: 4})
	require.NoError(t, err)
	assert.True(t, res.Partitioned && !res.Created)
	assert.Contains(t, []int{2, 3}, res.PartitionsCreated, "two more ahead (three when a UTC day began meanwhile)")
}
