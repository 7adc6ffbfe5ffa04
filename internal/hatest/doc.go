// Package hatest holds the test of idem under a high-availability manager,
// pg_auto_failover (Debian's postgresql-15-auto-failover and
// pg-auto-failover-cli; scripts/ensure-autofailover.sh installs them): a
// monitor and two nodes on this machine, a retry storm through both
// adapters, a switchover and a kill of the primary in the middle of it.
//
// Its files build only with the hatest tag, so that the root module's
// go test ./... does not run it (it takes a minute or two):
//
//	go test -tags hatest -race -count=1 ./internal/hatest
//
// It fails, never skips, when pg_auto_failover or PostgreSQL's server
// binaries are missing.
package hatest
