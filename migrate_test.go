package idem

import (
	"context"
	"strings"
	"testing"

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
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM pg_index WHERE indrelid = to_regclass($1)`, quoteIdent(name)).Scan(&indexes))
		assert.Equal(t, 2, indexes, "%s (%d bytes): the primary key and the claimed_at index", name, len(name))
		assert.LessOrEqual(t, len(indexName(name)), 63)
	}
}
