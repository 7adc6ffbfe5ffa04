package idemops

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
)

// Durability is what a commit on the checked server waits for, as
// PostgreSQL sees it, and so whether an event answered 2xx survives the
// loss of that server. It is information, never a finding: managed services
// often replicate below PostgreSQL's view (at the storage layer), which
// this cannot see. See docs/durability.md.
type Durability struct {
	// InRecovery: the checked server is a standby, not the primary the
	// middleware writes to.
	InRecovery bool
	// SynchronousCommit is synchronous_commit for the checking role and
	// database (the application's role may set its own).
	SynchronousCommit string
	// SynchronousStandbyNames is the server's synchronous_standby_names.
	SynchronousStandbyNames string
	// SyncStandbys are the application names of the standbys that confirm
	// commits now (pg_stat_replication sync_state "sync" or "quorum").
	SyncStandbys []string
	// OtherReplicas counts the other replication connections: asynchronous
	// or potential standbys, and logical replication.
	OtherReplicas int
	// Hidden counts the replication connections whose state the checking
	// role may not see (it needs pg_read_all_stats).
	Hidden int
	// Summary says, in a sentence or two, what this means for events
	// answered 2xx.
	Summary string
}

// Synchronous reports whether a commit on the checked server waits, now,
// for a synchronous standby to confirm it, so that an event answered 2xx
// survives a failover to that standby: the server is a primary,
// synchronous_commit is on, remote_apply or remote_write, and a standby
// named by synchronous_standby_names confirms commits (pg_stat_replication
// sync_state "sync" or "quorum").
//
// It is false after a failover while the new primary runs without a
// standby (pg_auto_failover's wait_primary, Patroni's synchronous mode
// without a replica): commits are answered unreplicated. It is false too
// when synchronous_standby_names is set but no standby confirms (commits
// then wait), and when the role may not see the standbys' state (it needs
// pg_read_all_stats). Storage-level replication (some managed services)
// is invisible here: Synchronous is false there, whatever the service does.
func (d Durability) Synchronous() bool {
	switch d.SynchronousCommit {
	case "on", "remote_apply", "remote_write":
	default:
		return false
	}
	return !d.InRecovery && d.SynchronousStandbyNames != "" && len(d.SyncStandbys) > 0
}

// ReadDurability reads what a commit on db's server waits for now: Check's
// Report.Durability, without reading the idempotency table. It reads only
// settings and pg_stat_replication, so a service can call it every few
// seconds to alert, or to stop acknowledging events, while Synchronous is
// false (after a failover, until a standby is back). It reports the
// server of one of db's connections: with a multi-host URL, the one the
// pool connects to. With a pgx pool, pass stdlib.OpenDBFromPool(pool),
// opened once.
func ReadDurability(ctx context.Context, db *sql.DB) (Durability, error) {
	d, err := readDurability(ctx, db)
	if err != nil {
		return d, fmt.Errorf("idem: read durability: %w", err)
	}
	return d, nil
}

// queryRower is a *sql.DB, *sql.Conn or *sql.Tx.
type queryRower interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// readDurability reads the server's replication settings and state.
func readDurability(ctx context.Context, tx queryRower) (Durability, error) {
	var (
		d    Durability
		sync string
	)
	err := tx.QueryRowContext(ctx, `SELECT pg_is_in_recovery(), current_setting('synchronous_commit'),
       current_setting('synchronous_standby_names'),
       coalesce(string_agg(application_name, ',' ORDER BY application_name) FILTER (WHERE sync_state IN ('sync', 'quorum')), ''),
       count(*) FILTER (WHERE sync_state NOT IN ('sync', 'quorum')),
       count(*) FILTER (WHERE sync_state IS NULL)
FROM pg_stat_replication`).Scan(&d.InRecovery, &d.SynchronousCommit, &d.SynchronousStandbyNames, &sync, &d.OtherReplicas, &d.Hidden)
	if err != nil {
		return d, err
	}
	if sync != "" {
		d.SyncStandbys = strings.Split(sync, ",")
	}
	d.Summary = d.summary()
	return d, nil
}

// summary says what the settings mean for an event answered 2xx.
func (d Durability) summary() string {
	const lost = "events answered 2xx can be lost by a failover (their senders will not redeliver them)"
	switch {
	case d.InRecovery:
		return "this server is a standby: check the primary the middleware writes to"
	case d.SynchronousCommit == "off":
		return "synchronous_commit is off: a commit is answered before it is even flushed to disk here, so " +
			"events answered 2xx can be lost by a crash of this server, and by any failover"
	case d.SynchronousStandbyNames == "" && d.Hidden > 0:
		return fmt.Sprintf("no synchronous standby (synchronous_standby_names is empty), and %d replication connection(s) this role may not see (grant pg_read_all_stats): "+
			"a commit waits for no standby, so %s, unless the service replicates below PostgreSQL", d.Hidden, lost)
	case d.SynchronousStandbyNames == "":
		return "no synchronous standby (synchronous_standby_names is empty): a commit is answered once flushed here, so " +
			lost + ", unless the service replicates below PostgreSQL (its storage)"
	case d.SynchronousCommit == "local":
		return "synchronous_commit is local: a commit does not wait for the synchronous standby, so " + lost
	case len(d.SyncStandbys) == 0 && d.Hidden > 0:
		return fmt.Sprintf("synchronous_standby_names is %q; this role may not see which standbys confirm (grant pg_read_all_stats)", d.SynchronousStandbyNames)
	case len(d.SyncStandbys) == 0:
		return fmt.Sprintf("synchronous_standby_names is %q but no standby confirms commits now: every commit waits "+
			"(requests are answered 503 at HandlerTimeout, and their keys answer 409) until one connects", d.SynchronousStandbyNames)
	}
	s := fmt.Sprintf("commits wait for the synchronous standby %s (synchronous_commit %s): an event answered 2xx survives a failover to it",
		strings.Join(d.SyncStandbys, ", "), d.SynchronousCommit)
	if d.SynchronousCommit == "remote_write" {
		s += ", unless its operating system crashes too"
	}
	return s
}
