package idem

// Test helpers shared with the external test package idem_test.
var (
	OpenTestDB      = openTestDB
	NewTestTable    = newTestTable
	TestDatabaseURL = testDatabaseURL
	LockID          = lockID
)

// ExampleDB gives Example functions a database and a migrated table.
var ExampleDB = exampleDB
