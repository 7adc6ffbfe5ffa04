// Package idemops is the operations side of idem: what an operator runs
// against the idempotency table, beside the middleware that claims its
// keys. Sweep and RunSweeper delete the keys older than the retention (on a
// partitioned table, drop whole partitions, and keep partitions ready
// ahead); Check runs the scheduled assertions an alert can hang on; Stats
// counts the keys by source. The idem command (cmd/idem) is these
// functions behind flags.
//
// Each takes the *sql.DB of the application's database (for a pgx pool,
// stdlib.OpenDBFromPool) and the table's name as idem.Options.Table takes
// it. See docs/operations.md.
package idemops
