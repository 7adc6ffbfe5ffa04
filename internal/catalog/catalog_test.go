package catalog

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestPartitionGapsAndNames(t *testing.T) {
	day := 24 * time.Hour
	at := func(d int) time.Time { return time.Date(2026, 12, d, 0, 0, 0, 0, time.UTC) }
	start, end := at(10), at(14)
	// Nothing yet: one partition per day.
	assert.Equal(t, [][2]time.Time{{at(10), at(11)}, {at(11), at(12)}, {at(12), at(13)}, {at(13), at(14)}}, gaps(nil, start, end, day))
	// Someone else's partitions (half a day, then a week from the 12th at
	// noon): only what they leave uncovered.
	others := []Partition{
		{From: at(10), To: at(10).Add(12 * time.Hour)},
		{From: at(12).Add(12 * time.Hour), To: at(19)},
	}
	assert.Equal(t, [][2]time.Time{{at(10).Add(12 * time.Hour), at(11)}, {at(11), at(12)}, {at(12), at(12).Add(12 * time.Hour)}},
		gaps(others, start, end, day))
	// A partition from MINVALUE, and a pending detach that covers nothing.
	assert.Equal(t, [][2]time.Time{{at(13), at(14)}},
		gaps([]Partition{{To: at(13)}, {From: at(13), To: at(14), Pending: true}}, start, end, day))

	assert.Equal(t, at(10), alignDown(at(10).Add(23*time.Hour), day))
	assert.Equal(t, "t_p20261210_0000", PartitionName("t", at(10)))
	long := PartitionName(strings.Repeat("x", 63), at(10))
	assert.Len(t, long, 63)
	assert.NotEqual(t, long, PartitionName(strings.Repeat("x", 62)+"y", at(10)))
}
