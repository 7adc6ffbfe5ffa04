package idem

import (
	"github.com/pgidem/idem/internal/catalog"
	"github.com/pgidem/idem/internal/summary"
	"github.com/pgidem/idem/internal/testdb"
)

// Test helpers shared with the external test package idem_test.
var (
	OpenTestDB     = openTestDB
	NewTestTable   = newTestTable
	NewPlainTable  = newPlainTestTable
	NewPartitioned = newPartitionedTestTable
	AddPast        = testdb.AddPastPartition
	// PartitionedLayout: the suite runs on partitioned tables (IDEM_LAYOUT).
	PartitionedLayout = partitionedLayout
	TestDatabaseURL   = testDatabaseURL
	LockID            = catalog.LockID
	PartitionName     = catalog.PartitionName
	OpenDSN           = openDSN
	DSNOf             = dsnOf
)

// LocalWaiters is how many deliveries wait in m's memory for another
// delivery of their key on the same instance.
func LocalWaiters(m *Middleware) int64 { return m.flights.waiters.Load() }

// SummariesOf returns the summaries of m's table's past partitions.
func SummariesOf(m *Middleware) *summary.Summaries {
	return m.drv.(summary.Summarised).Summaries()
}
