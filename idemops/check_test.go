package idemops

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// finding returns the report's finding of the named check, failing the test
// when there is none; every finding must say what happened and what to do.
func finding(t *testing.T, r *Report, check string) Finding {
	t.Helper()
	for _, f := range r.Findings {
		if f.Check == check {
			assert.NotEmpty(t, f.What)
			assert.NotEmpty(t, f.Action)
			return f
		}
	}
	t.Fatalf("no %s finding in %+v", check, r.Findings)
	return Finding{}
}

func checks(r *Report) []string {
	var out []string
	for _, f := range r.Findings {
		out = append(out, f.Check)
	}
	return out
}

func TestCheckOfAHealthyTableHasNoFindings(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newTable(t, db)
	insertKeys(t, db, table, "old_", 10, 20*day)
	insertKeys(t, db, table, "new_", 5, time.Minute)

	r, err := Check(context.Background(), db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings)
	assert.Equal(t, SeverityOK, r.Severity())
	assert.Equal(t, table, r.Table)
	assert.Equal(t, int64(15), r.Rows)
	assert.Positive(t, r.TableBytes)
	assert.False(t, r.CheckedAt.IsZero())
	assert.InDelta(t, float64(20*day), float64(r.OldestAge), float64(time.Hour))
	assert.Equal(t, r.CheckedAt.Sub(r.OldestKey), r.OldestAge)
	assert.Zero(t, r.InFlight)
	assert.Equal(t, DefaultHorizon, r.Horizon)
	assert.Equal(t, DefaultRetention, r.Retention)
	assert.Equal(t, DefaultStuckAfter, r.StuckAfter)
	assert.Equal(t, DefaultOverdueGrace, r.OverdueGrace)
}

// The test server has no standby: Check says that events answered 2xx can
// be lost by a failover, as information, not a finding. (The failover
// tests check what it says of a synchronous standby.)
func TestCheckReportsDurability(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newTable(t, db)
	r, err := Check(context.Background(), db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings)
	d := r.Durability
	assert.False(t, d.InRecovery)
	assert.Equal(t, "on", d.SynchronousCommit)
	assert.Empty(t, d.SynchronousStandbyNames)
	assert.Empty(t, d.SyncStandbys)
	assert.Contains(t, d.Summary, "no synchronous standby")
	assert.Contains(t, d.Summary, "can be lost by a failover")

	// synchronous_commit = off is said first: even a crash loses events.
	// A role's setting, not a startup parameter, which PgBouncer refuses.
	u, err := url.Parse(databaseURL(t))
	require.NoError(t, err)
	u.User = url.User(newRole(t, db, "SET synchronous_commit = off"))
	off, err := sql.Open("pgx", u.String())
	require.NoError(t, err)
	defer off.Close()
	r, err = Check(context.Background(), off, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Equal(t, "off", r.Durability.SynchronousCommit)
	assert.Contains(t, r.Durability.Summary, "lost by a crash of this server")
}

func TestCheckOfAnEmptyTable(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newTable(t, db)
	r, err := Check(context.Background(), db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings, "a new table is not too young: nothing was deleted")
	assert.Zero(t, r.Rows)
	assert.True(t, r.OldestKey.IsZero())
	assert.Zero(t, r.OldestAge)
}

func TestCheckFindsKeysOverdueForTheSweeper(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newPlainTable(t, db)
	insertKeys(t, db, table, "overdue_", 3, 30*day+2*time.Hour)
	insertKeys(t, db, table, "in_grace_", 2, 30*day+30*time.Minute)
	insertKeys(t, db, table, "fresh_", 2, time.Hour)

	r, err := Check(context.Background(), db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Equal(t, int64(3), r.OverdueRows, "keys past the retention by less than the grace are not overdue")
	assert.Equal(t, SeverityWarning, r.Severity())
	fd := finding(t, r, "overdue_keys")
	assert.Contains(t, fd.What, "3 key(s)")
	assert.Equal(t, []string{"overdue_keys"}, checks(r))

	r, err = Check(context.Background(), db, CheckOptions{Table: table, Retention: 40 * day})
	require.NoError(t, err)
	assert.Empty(t, r.Findings, "with a longer retention nothing is overdue")
}

func TestCheckFindsKeysDeletedYoungerThanTheHorizon(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openDB(t)
	table := newPlainTable(t, db)
	insertKeys(t, db, table, "k", 5, time.Hour)

	r, err := Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings, "young keys in a table that never lost one: a new deployment")

	// Delete a key, and make the server publish the deletion in its
	// statistics now rather than within the next seconds.
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	_, err = conn.ExecContext(ctx, `DELETE FROM "`+table+`" WHERE event_id = 'k1'`)
	require.NoError(t, err)
	_, err = conn.ExecContext(ctx, `SELECT pg_stat_force_next_flush()`)
	require.NoError(t, err)
	waitFor(t, "the deletion in the statistics", func() bool {
		var n int64
		require.NoError(t, db.QueryRow(`SELECT pg_stat_get_tuples_deleted(to_regclass($1))`, `"`+table+`"`).Scan(&n))
		return n > 0
	})

	r, err = Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Positive(t, r.Deleted)
	fd := finding(t, r, "keys_younger_than_horizon")
	assert.Equal(t, SeverityWarning, fd.Severity)
	assert.Contains(t, fd.What, "72h0m0s")

	r, err = Check(ctx, db, CheckOptions{Table: table, Horizon: 30 * time.Minute})
	require.NoError(t, err)
	assert.Empty(t, r.Findings, "keys older than a 30-minute horizon are fine")
}

func TestCheckFindsARetentionShorterThanTheHorizon(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	table := newTable(t, db)
	r, err := Check(context.Background(), db, CheckOptions{Table: table, Horizon: 30 * day, Retention: 7 * day})
	require.NoError(t, err)
	fd := finding(t, r, "retention_below_horizon")
	assert.Equal(t, SeverityCritical, fd.Severity)
	assert.Contains(t, fd.What, "168h0m0s")
	assert.Contains(t, fd.What, "720h0m0s")
}

func TestCheckErrors(t *testing.T) {
	t.Parallel()
	db := openDB(t)
	_, err := Check(context.Background(), db, CheckOptions{Table: "no_such_table"})
	assert.ErrorContains(t, err, "idem: check no_such_table: the table does not exist")
	_, err = Check(context.Background(), db, CheckOptions{StuckAfter: -time.Second})
	assert.ErrorContains(t, err, "StuckAfter")
	_, err = Check(context.Background(), db, CheckOptions{Table: "a.b.c"})
	assert.Error(t, err)
}

func TestSeverityNames(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "ok", SeverityOK.String())
	assert.Equal(t, "warning", SeverityWarning.String())
	assert.Equal(t, "critical", SeverityCritical.String())
	assert.Equal(t, "Severity(9)", Severity(9).String())
}

// Check warns when fewer than two partitions are ready ahead, and is
// critical when none holds the current time; a sweep puts both right.
func TestCheckOfAPartitionedTableWatchesThePartitionsAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openDB(t)
	table := newPartitionedTable(t, db, 24*time.Hour)
	r, err := Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings)
	assert.Equal(t, idem.DefaultPartitionsAhead, r.PartitionsAhead)

	// The past partition, the current one and three ahead, oldest first:
	// drop two of those ahead.
	parts := r.Partitions
	require.Len(t, parts, 5)
	assert.True(t, parts[0].From.IsZero(), "the past partition, from MINVALUE, comes first")
	for _, p := range parts[3:] {
		_, err := db.Exec(`DROP TABLE "` + p.Name + `"`)
		require.NoError(t, err)
	}
	r, err = Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Equal(t, 1, r.PartitionsAhead)
	assert.Equal(t, []string{"few_partitions_ahead"}, checks(r))
	assert.Equal(t, SeverityWarning, r.Severity())

	_, err = db.Exec(`DROP TABLE "` + r.CurrentPartition + `"`)
	require.NoError(t, err)
	r, err = Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.CurrentPartition)
	assert.Equal(t, []string{"no_current_partition"}, checks(r))
	assert.Equal(t, SeverityCritical, r.Severity())

	_, err = Sweep(ctx, db, SweepOptions{Table: table})
	require.NoError(t, err)
	r, err = Check(ctx, db, CheckOptions{Table: table})
	require.NoError(t, err)
	assert.Empty(t, r.Findings, "the sweep added the current partition and those ahead")
	assert.Equal(t, idem.DefaultPartitionsAhead, r.PartitionsAhead)
}

// Synchronous is true only on a primary whose commits wait for a standby
// that confirms them now; ReadDurability reads the same state as Check
// without the table (the test server has no standby: false; the HA test,
// internal/hatest, reads it true on a synchronous pair and false in
// wait_primary).
func TestSynchronous(t *testing.T) {
	t.Parallel()
	confirmed := Durability{SynchronousCommit: "on", SynchronousStandbyNames: "ANY 1 (node_1, node_2)", SyncStandbys: []string{"node_2"}}
	assert.True(t, confirmed.Synchronous())
	for name, change := range map[string]func(*Durability){
		"a standby":                                   func(d *Durability) { d.InRecovery = true },
		"synchronous_commit local":                    func(d *Durability) { d.SynchronousCommit = "local" },
		"synchronous_commit off":                      func(d *Durability) { d.SynchronousCommit = "off" },
		"no synchronous_standby_names (wait_primary)": func(d *Durability) { d.SynchronousStandbyNames = "" },
		"no standby confirms (commits wait)":          func(d *Durability) { d.SyncStandbys = nil },
	} {
		d := confirmed
		change(&d)
		assert.False(t, d.Synchronous(), name)
	}
	for _, level := range []string{"remote_apply", "remote_write"} {
		d := confirmed
		d.SynchronousCommit = level
		assert.True(t, d.Synchronous(), level)
	}

	db := openDB(t)
	d, err := ReadDurability(context.Background(), db)
	require.NoError(t, err)
	assert.False(t, d.Synchronous())
	assert.Equal(t, "on", d.SynchronousCommit)
	assert.Contains(t, d.Summary, "no synchronous standby")

	table := newTable(t, db)
	r, err := Check(context.Background(), db, CheckOptions{Table: table, RequireSynchronous: true})
	require.NoError(t, err)
	require.Len(t, r.Findings, 1)
	assert.Equal(t, "not_synchronous", r.Findings[0].Check)
	assert.Equal(t, SeverityCritical, r.Severity())
	assert.Contains(t, r.Findings[0].What, d.Summary)
}
