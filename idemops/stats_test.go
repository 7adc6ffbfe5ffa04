package idemops

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestStatsOfAnEmptyOrMissingTable(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newTable(t, db)
	s, err := Stats(context.Background(), db, StatsOptions{Table: table})
	require.NoError(t, err)
	assert.Zero(t, s.Rows)
	assert.Empty(t, s.Sources)
	assert.True(t, s.Oldest.IsZero())
	_, err = Stats(context.Background(), db, StatsOptions{Table: "no_such_table"})
	assert.ErrorContains(t, err, "does not exist")
	_, err = Stats(context.Background(), db, StatsOptions{MaxSources: -1})
	assert.Error(t, err)
}
