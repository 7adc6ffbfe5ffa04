package idem

// Test helpers shared with the external test package idem_test.
var (
	OpenTestDB      = openTestDB
	NewTestTable    = newTestTable
	TestDatabaseURL = testDatabaseURL
	LockID          = lockID
)
