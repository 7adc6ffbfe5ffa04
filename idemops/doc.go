// Package idemops is the operations side of idem: what an operator runs
// against the idempotency table, beside the middleware that claims its
// keys. Sweep and RunSweeper delete the keys older than the retention (on a
// partitioned table, drop whole partitions, and keep partitions ready
// ahead); Check runs the scheduled assertions an alert can hang on; Stats
// counts the keys by source; ShowKey, ListKeys, FindKeys and ForgetKey look
// at one key, list the keys in a state, find an event id under every
// source, and delete one key so that its next delivery runs the handler
// again. The idem command (cmd/idem) is these functions behind flags, and
// the idemui module shows them as web pages.
//
// Each takes the *sql.DB of the application's database (for a pgx pool,
// stdlib.OpenDBFromPool) and the table's name as idem.Options.Table takes
// it. See docs/operations.md.
package idemops
