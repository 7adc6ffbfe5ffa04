package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"
)

// Check defaults, for the zero values of CheckOptions.
const (
	// DefaultHorizon is the provider retry horizon Check assumes when
	// CheckOptions.Horizon is 0: 72 hours (Stripe live mode, Paddle).
	DefaultHorizon = 72 * time.Hour

	// DefaultStuckAfter is how long a claim may stay in flight before Check
	// reports it, when CheckOptions.StuckAfter is 0. The middleware bounds
	// a claim by Options.HandlerTimeout (30s by default), so a claim open
	// for minutes is held by something the middleware cannot end.
	DefaultStuckAfter = 5 * time.Minute

	// DefaultOverdueGrace is how long past the retention a key may live
	// before Check counts it as overdue, when CheckOptions.OverdueGrace is
	// 0: keys expire continuously and a sweep runs every few minutes, so a
	// few are always just past the retention.
	DefaultOverdueGrace = time.Hour

	// maxListed bounds the stuck claims and unanswered keys a Report lists.
	maxListed = 20
)

// Severity grades a Finding and a Report.
type Severity int

// The severities, in increasing order.
const (
	// SeverityOK: nothing to do.
	SeverityOK Severity = iota
	// SeverityWarning: needs a look within the day; nothing runs twice yet.
	SeverityWarning
	// SeverityCritical: a key answers wrongly now, or soon will: act now.
	SeverityCritical
)

// String returns "ok", "warning" or "critical".
func (s Severity) String() string {
	switch s {
	case SeverityOK:
		return "ok"
	case SeverityWarning:
		return "warning"
	case SeverityCritical:
		return "critical"
	}
	return "Severity(" + strconv.Itoa(int(s)) + ")"
}

// Finding is one problem that Check found.
type Finding struct {
	Severity Severity
	// Check names the assertion, stable for alert routing:
	// "retention_below_horizon", "unanswered_keys", "stuck_claims",
	// "retention_below_horizon", "unanswered_keys", "stuck_claims",
	// "expired_leases", "claims_not_visible", "keys_younger_than_horizon",
	// "overdue_keys", and on a partitioned table "no_current_partition",
	// "few_partitions_ahead".
	Check string
	// What happened, with the numbers.
	What string
	// Action is what an operator should do about it.
	Action string
}

// CheckOptions configures Check. The zero value of every field means its
// documented default.
type CheckOptions struct {
	// Table is the idempotency table, "" for DefaultTable; a name as
	// Options.Table takes it.
	Table string

	// Horizon is the longest retry horizon of the table's senders: keys
	// must live at least that long. 0 means DefaultHorizon (72h).
	Horizon time.Duration

	// Retention is the sweeper's retention (SweepOptions.Retention): keys
	// much older than that mean the sweeper is not keeping up. 0 means
	// DefaultRetention (30 days).
	Retention time.Duration

	// StuckAfter is how long a claim may be in flight before it counts as
	// stuck. 0 means DefaultStuckAfter (5m).
	StuckAfter time.Duration

	// OverdueGrace is how long past Retention a key may live before it
	// counts as overdue. 0 means DefaultOverdueGrace (1h).
	OverdueGrace time.Duration
}

// InFlightClaim is an open transaction that holds a claim: a session that
// holds an advisory lock and has written to the table in its current
// transaction. Its key is not visible to anyone until it commits, so it is
// identified by its session. Fields other than PID are zero when the
// checking role may not see the session (it needs pg_read_all_stats, or to
// be the application's role).
type InFlightClaim struct {
	PID         int
	XactStart   time.Time     // when its transaction began
	Age         time.Duration // how long it has been open, by the database's clock
	State       string        // "active", "idle in transaction", ...
	WaitEvent   string        // "Type:Event" when it waits, else ""
	Application string        // application_name
	Client      string        // client address, "" for a local socket
	Query       string        // its latest statement, cut to 200 characters
}

// UnansweredKey is a committed key without a stored answer.
type UnansweredKey struct {
	Key       Key
	ClaimedAt time.Time
}

// Report is the result of Check: the numbers, and the findings worked out
// from them.
type Report struct {
	Table        string
	CheckedAt    time.Time // the database's now()
	Horizon      time.Duration
	Retention    time.Duration
	StuckAfter   time.Duration
	OverdueGrace time.Duration

	Rows       int64     // committed keys
	TableBytes int64     // the table with its indexes and TOAST
	OldestKey  time.Time // claimed_at of the oldest committed key; zero when there are none
	OldestAge  time.Duration
	Deleted    int64 // keys deleted since the server's statistics were last reset

	// OverdueRows are keys older than Retention plus OverdueGrace; on a
	// partitioned table, the keys of partitions that ended longer ago than
	// that (the sweep drops a partition once it ended Retention ago).
	OverdueRows int64

	// Partitioned tables only (docs/partitioning.md).
	PartitionReport

	// Unanswered counts committed keys without an answer that are not
	// lease-mode claims; UnansweredKeys lists the oldest 20.
	Unanswered     int64
	UnansweredKeys []UnansweredKey

	// Lease mode: LiveLeases counts keys in progress whose lease still
	// runs (handlers at work); ExpiredLeases those whose lease ran out
	// without an answer: originals that crashed or were killed, which the
	// next delivery of each key takes over. ExpiredLeaseKeys lists the
	// oldest 20.
	LiveLeases       int64
	ExpiredLeases    int64
	ExpiredLeaseKeys []UnansweredKey

	// InFlight counts the claims in flight (open claim transactions);
	// Stuck lists the oldest 20 of those open for longer than StuckAfter,
	// and Invisible counts the claim sessions whose age the checking role
	// may not see.
	InFlight  int
	Stuck     []InFlightClaim
	Invisible int

	// Findings are the problems found, most severe first; none when
	// healthy.
	Findings []Finding

	// Durability is whether events answered 2xx survive a failover of the
	// checked server: information, never a finding.
	Durability Durability
}

// Severity returns the most severe finding's severity, SeverityOK when there
// are none.
func (r *Report) Severity() Severity {
	worst := SeverityOK
	for _, f := range r.Findings {
		if f.Severity > worst {
			worst = f.Severity
		}
	}
	return worst
}

// Check runs the scheduled assertions of the idempotency table and reports
// what it found; it changes nothing. It reads the table once (count and
// oldest key: a full scan, so run it every few minutes, not every second)
// and the server's lock and activity views, all in one read-only snapshot.
// A missing table, a database error or invalid options are an error, not a
// finding.
//
// The assertions: claims in flight for longer than StuckAfter (critical);
// committed keys without an answer, each answering 409 forever (critical);
// a Retention shorter than the Horizon (critical); keys deleted while
// younger than the Horizon (warning: the oldest key is younger than the
// Horizon although keys have been deleted); keys overdue for the sweeper
// (warning); claim sessions the checking role may not see (warning).
func Check(ctx context.Context, db *sql.DB, opts CheckOptions) (*Report, error) {
	t, err := parseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	r := &Report{
		Table:        t.name,
		Horizon:      orDefault(opts.Horizon, DefaultHorizon),
		Retention:    orDefault(opts.Retention, DefaultRetention),
		StuckAfter:   orDefault(opts.StuckAfter, DefaultStuckAfter),
		OverdueGrace: orDefault(opts.OverdueGrace, DefaultOverdueGrace),
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"Horizon", r.Horizon}, {"Retention", r.Retention}, {"StuckAfter", r.StuckAfter}, {"OverdueGrace", r.OverdueGrace}} {
		if d.v < 0 {
			return nil, fmt.Errorf("idem: check: CheckOptions.%s %v is negative", d.name, d.v)
		}
	}

	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		if err := tableExists(ctx, tx, t); err != nil {
			return err
		}
		overdueBefore, err := r.PartitionReport.read(ctx, tx, t, r.Retention+r.OverdueGrace)
		if err != nil {
			return err
		}
		var oldest sql.NullTime
		err = tx.QueryRowContext(ctx, `SELECT now(), count(*), min(claimed_at),
       count(*) FILTER (WHERE claimed_at < coalesce($3::timestamptz, now() - $1::bigint * interval '1 microsecond')),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until IS NULL),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until >= now()),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until < now()),
       (SELECT sum(pg_total_relation_size(relid))::bigint FROM `+treeSQL("$2")+`),
       (SELECT coalesce(sum(pg_stat_get_tuples_deleted(relid)), 0)::bigint FROM `+treeSQL("$2")+`)
FROM `+t.quoted, (r.Retention+r.OverdueGrace).Microseconds(), t.quoted, overdueBefore).
			Scan(&r.CheckedAt, &r.Rows, &oldest, &r.OverdueRows, &r.Unanswered, &r.LiveLeases, &r.ExpiredLeases, &r.TableBytes, &r.Deleted)
		if err != nil {
			return err
		}
		if oldest.Valid {
			r.OldestKey = oldest.Time
			r.OldestAge = r.CheckedAt.Sub(oldest.Time)
		}
		if r.Unanswered > 0 {
			if r.UnansweredKeys, err = listKeys(ctx, tx, t, "lease_until IS NULL"); err != nil {
				return err
			}
		}
		if r.ExpiredLeases > 0 {
			if r.ExpiredLeaseKeys, err = listKeys(ctx, tx, t, "lease_until < now()"); err != nil {
				return err
			}
		}
		if r.Durability, err = readDurability(ctx, tx); err != nil {
			return err
		}
		claims, err := inFlightClaims(ctx, tx, t)
		if err != nil {
			return err
		}
		r.InFlight = len(claims)
		for _, c := range claims {
			switch {
			case c.XactStart.IsZero():
				r.Invisible++
			case c.Age > r.StuckAfter && len(r.Stuck) < maxListed:
				r.Stuck = append(r.Stuck, c)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idem: check %s: %w", t.name, err)
	}
	r.Findings = findings(r)
	return r, nil
}

func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// findings works out the findings from the numbers, most severe first.
func findings(r *Report) []Finding {
	var out []Finding
	add := func(s Severity, check, what, action string) {
		out = append(out, Finding{Severity: s, Check: check, What: what, Action: action})
	}
	if r.Retention < r.Horizon {
		add(SeverityCritical, "retention_below_horizon",
			fmt.Sprintf("the retention (%v) is shorter than the providers' retry horizon (%v): keys are deleted while their sender still retries, and such a retry runs the handler again", r.Retention, r.Horizon),
			"Raise the sweeper's retention well above the longest retry horizon of every sender (see the retention table in docs/operations.md), or correct -horizon/-retention if they do not match the deployment.")
	}
	if r.Unanswered > 0 {
		add(SeverityCritical, "unanswered_keys",
			fmt.Sprintf("%d key(s) were committed without an answer (the oldest: %s, claimed %s); each answers 409 to every redelivery until it is resolved (or swept, once older than the retention)", r.Unanswered, describeKeys(r.UnansweredKeys), r.UnansweredKeys[0].ClaimedAt.UTC().Format(time.RFC3339)),
			"A handler committed or rolled back the middleware's transaction itself (look for ErrTxMisuse in the logs) and must be fixed. Then, per key: if its side effect happened, store an answer (UPDATE ... SET response_status = 200, response_body = '', completed_at = now() WHERE source = ... AND event_id = ...); if not, DELETE the row so the next delivery runs the handler.")
	}
	if r.ExpiredLeases > 0 {
		k := r.ExpiredLeaseKeys[0]
		add(SeverityWarning, "expired_leases",
			fmt.Sprintf("%d lease-mode key(s) have a lease that ran out without an answer (the oldest: %s, claimed %s): their original crashed or was killed mid-handler; the next delivery of each takes it over and runs the handler again", r.ExpiredLeases, describeKeys(r.ExpiredLeaseKeys), k.ClaimedAt.UTC().Format(time.RFC3339)),
			"Find why the instance died (its logs, OOM kills, deploys without graceful shutdown). Nothing else is needed when the sender retries; if it has given up, ask it to resend the event, or DELETE the row so a manual replay runs the handler.")
	}
	if n := len(r.Stuck); n > 0 {
		c := r.Stuck[0]
		add(SeverityCritical, "stuck_claims",
			fmt.Sprintf("%d claim(s) in flight for longer than %v; the oldest for %v (pid %d, %s, application %q); every delivery of their keys is answered 409, and the open transactions hold back vacuum for the whole database", n, r.StuckAfter, c.Age.Round(time.Second), c.PID, c.State, c.Application),
			"Look at the sessions (SELECT * FROM pg_stat_activity WHERE pid = ...). A session idle in transaction has lost its application: end it with SELECT pg_terminate_backend(pid); the claim rolls back and the sender's next retry runs the handler. An active one is slow: find what it waits for (wait_event) before ending it; IPC:SyncRep is a COMMIT waiting for a synchronous standby: never end it (that commits it locally, unreplicated), bring the standby back. Set idle_in_transaction_session_timeout on the application's role.")
	}
	if r.Invisible > 0 {
		add(SeverityWarning, "claims_not_visible",
			fmt.Sprintf("%d claim session(s) are hidden from the checking role, so stuck claims cannot be measured", r.Invisible),
			"Run the check as the application's role, or GRANT pg_read_all_stats TO the checking role.")
	}
	if r.Rows > 0 && r.Deleted > 0 && r.OldestAge < r.Horizon {
		add(SeverityWarning, "keys_younger_than_horizon",
			fmt.Sprintf("the oldest key is %v old, younger than the providers' retry horizon (%v), although %d key(s) have been deleted: keys may be deleted while their sender still retries", r.OldestAge.Round(time.Second), r.Horizon, r.Deleted),
			"Check the sweeper's retention (it must exceed the horizon) and who else deletes from the table. If traffic only started, or paused for longer than the retention, this resolves itself once the oldest key is older than the horizon.")
	}
	if r.OverdueRows > 0 {
		add(SeverityWarning, "overdue_keys",
			fmt.Sprintf("%d key(s) are older than the retention (%v) plus %v: the sweeper is not running or not keeping up; the oldest key is %v old", r.OverdueRows, r.Retention, r.OverdueGrace, r.OldestAge.Round(time.Second)),
			"Check that the sweep job runs and succeeds (its logs, the CronJob's last runs). If it stops at its batch cap every time, raise -batch or -max-batches, or run it more often.")
	}
	out = append(out, partitionFindings(r)...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].Severity > out[j].Severity })
	return out
}

func describeKeys(keys []UnansweredKey) string {
	k := keys[0].Key
	return strconv.Quote(k.Source) + "/" + strconv.Quote(k.EventID)
}

// readOnly runs f in a read-only REPEATABLE READ transaction: one snapshot
// and one now() for every query of a report.
func readOnly(ctx context.Context, db *sql.DB, f func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// errNoTable is returned when the table does not exist.
var errNoTable = errors.New("the table does not exist (run Migrate, or idem migrate)")

func tableExists(ctx context.Context, tx *sql.Tx, t table) error {
	var ok bool
	if err := tx.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.quoted).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return errNoTable
	}
	return nil
}

// listKeys lists the oldest keys without an answer that match cond.
func listKeys(ctx context.Context, tx *sql.Tx, t table, cond string) ([]UnansweredKey, error) {
	rows, err := tx.QueryContext(ctx, `SELECT source, event_id, claimed_at FROM `+t.quoted+`
WHERE completed_at IS NULL AND `+cond+` ORDER BY claimed_at LIMIT `+strconv.Itoa(maxListed))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []UnansweredKey
	for rows.Next() {
		var k UnansweredKey
		if err := rows.Scan(&k.Key.Source, &k.Key.EventID, &k.ClaimedAt); err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, rows.Err()
}

// inFlightClaims lists the open claim transactions on the table, oldest
// first. A claim in flight is an uncommitted insert, invisible to every
// other session, and holds a transaction-level advisory lock on its key
// until it ends: so a claim is a session of this database that holds a
// granted advisory lock on a bigint key and a lock on the table (taken by
// its INSERT, or by the read of a claim that inserts its row at the end, as
// idempgx does), the locks every claim transaction holds to its end. A
// duplicate in the few milliseconds between taking the lock and rolling
// back matches too; a sweep (no advisory lock) or a session waiting for a
// lock it does not hold does not.
func inFlightClaims(ctx context.Context, tx *sql.Tx, t table) ([]InFlightClaim, error) {
	rows, err := tx.QueryContext(ctx, `WITH d AS (SELECT oid FROM pg_database WHERE datname = current_database())
SELECT a.pid, a.xact_start, coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8,
       coalesce(a.state, ''), coalesce(a.wait_event_type || ':' || a.wait_event, ''),
       coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), coalesce(left(a.query, 200), '')
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
  AND EXISTS (SELECT 1 FROM pg_locks l, d WHERE l.pid = a.pid AND l.granted AND l.database = d.oid
              AND l.locktype = 'relation' AND l.relation = to_regclass($1))
  AND EXISTS (SELECT 1 FROM pg_locks l, d WHERE l.pid = a.pid AND l.granted AND l.database = d.oid
              AND l.locktype = 'advisory' AND l.objsubid = 1)
ORDER BY a.xact_start NULLS FIRST, a.pid`, t.quoted)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []InFlightClaim
	for rows.Next() {
		var (
			c     InFlightClaim
			start sql.NullTime
			age   float64
		)
		if err := rows.Scan(&c.PID, &start, &age, &c.State, &c.WaitEvent, &c.Application, &c.Client, &c.Query); err != nil {
			return nil, err
		}
		if start.Valid {
			c.XactStart = start.Time
			c.Age = time.Duration(age * float64(time.Second))
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// StatsOptions configures Stats. The zero value of every field means its
// documented default.
type StatsOptions struct {
	// Table is the idempotency table, "" for DefaultTable; a name as
	// Options.Table takes it.
	Table string
	// MaxSources is how many sources TableStats lists, the busiest first.
	// 0 means 100.
	MaxSources int
}

// SourceStats are the committed keys of one source.
type SourceStats struct {
	Source     string
	Completed  int64     // keys with a stored answer
	Unanswered int64     // keys committed without an answer (see Check)
	Leases     int64     // lease-mode keys in progress, live or expired
	Oldest     time.Time // claimed_at of its oldest key
	Newest     time.Time // claimed_at of its newest key
}

// TableStats describes the idempotency table.
type TableStats struct {
	Table      string
	Rows       int64 // committed keys
	Completed  int64
	Unanswered int64
	// Lease mode: keys in progress whose lease still runs, and those whose
	// lease ran out without an answer (crashed originals; see Check).
	LiveLeases, ExpiredLeases int64
	// InFlight counts the claims in flight: their keys are uncommitted
	// and invisible, so they are counted by session, not by source.
	InFlight   int
	Oldest     time.Time // zero when the table is empty
	Newest     time.Time
	TableBytes int64
	// Partitions lists a partitioned table's partitions, the oldest first,
	// with their keys; PartitionsAhead counts those wholly after now. Both
	// are empty on a plain table.
	Partitions      []PartitionStats
	PartitionsAhead int
	// Sources are the busiest sources, by committed keys;
	// OtherSources counts those left out by MaxSources.
	Sources      []SourceStats
	OtherSources int
}

// Stats counts the committed keys by source, completed and unanswered, with
// the oldest and newest key of each, and the claims in flight. Like Check,
// it reads the whole table once, in one read-only snapshot (a partitioned
// table's partitions are then counted once more, one by one).
func Stats(ctx context.Context, db *sql.DB, opts StatsOptions) (*TableStats, error) {
	t, err := parseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	limit := opts.MaxSources
	switch {
	case limit == 0:
		limit = 100
	case limit < 0:
		return nil, fmt.Errorf("idem: stats: MaxSources %d is negative", limit)
	}
	s := &TableStats{Table: t.name}
	err = readOnly(ctx, db, func(tx *sql.Tx) error {
		if err := tableExists(ctx, tx, t); err != nil {
			return err
		}
		// One scan: the busiest sources, and one total row over all of
		// them (total = true, with the number of sources).
		rows, err := tx.QueryContext(ctx, `WITH s AS (
    SELECT source, count(*) FILTER (WHERE completed_at IS NOT NULL) AS done,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until IS NULL) AS open,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until >= now()) AS live,
           count(*) FILTER (WHERE completed_at IS NULL AND lease_until < now()) AS expired,
           min(claimed_at) AS oldest, max(claimed_at) AS newest
    FROM `+t.quoted+` GROUP BY source),
top AS (SELECT * FROM s ORDER BY done + open + live + expired DESC, source LIMIT $1)
SELECT false, source, done, open, live, expired, oldest, newest, 0 FROM top
UNION ALL
SELECT true, '', coalesce(sum(done), 0)::bigint, coalesce(sum(open), 0)::bigint, coalesce(sum(live), 0)::bigint,
       coalesce(sum(expired), 0)::bigint, min(oldest), max(newest), count(*) FROM s`, limit)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				total          bool
				src            SourceStats
				live, expired  int64
				oldest, newest sql.NullTime
				sources        int
			)
			if err := rows.Scan(&total, &src.Source, &src.Completed, &src.Unanswered, &live, &expired, &oldest, &newest, &sources); err != nil {
				return err
			}
			src.Oldest, src.Newest = oldest.Time, newest.Time
			src.Leases = live + expired
			if !total {
				s.Sources = append(s.Sources, src)
				continue
			}
			s.OtherSources = sources
			s.Completed, s.Unanswered, s.LiveLeases, s.ExpiredLeases = src.Completed, src.Unanswered, live, expired
			s.Rows = s.Completed + s.Unanswered + live + expired
			s.Oldest, s.Newest = src.Oldest, src.Newest
		}
		if err := rows.Err(); err != nil {
			return err
		}
		s.OtherSources -= len(s.Sources)
		sort.Slice(s.Sources, func(i, j int) bool {
			a, b := s.Sources[i], s.Sources[j]
			if n, m := a.Completed+a.Unanswered+a.Leases, b.Completed+b.Unanswered+b.Leases; n != m {
				return n > m
			}
			return a.Source < b.Source
		})
		if err := tx.QueryRowContext(ctx, `SELECT sum(pg_total_relation_size(relid))::bigint FROM `+treeSQL("$1"), t.quoted).Scan(&s.TableBytes); err != nil {
			return err
		}
		if err := s.readPartitions(ctx, tx, t); err != nil {
			return err
		}
		claims, err := inFlightClaims(ctx, tx, t)
		s.InFlight = len(claims)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: stats %s: %w", t.name, err)
	}
	return s, nil
}
