package idemops

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/catalog"
)

// Check defaults, for the zero values of CheckOptions.
const (
	// DefaultHorizon is the provider retry horizon Check assumes when
	// CheckOptions.Horizon is 0: 72 hours (Stripe live mode, Paddle).
	DefaultHorizon = 72 * time.Hour

	// DefaultStuckAfter is how long a claim may stay in flight before Check
	// reports it, when CheckOptions.StuckAfter is 0. The middleware bounds
	// a claim by idem.Options.HandlerTimeout (30s by default), so a claim open
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
	// "expired_leases", "claims_not_visible", "keys_younger_than_horizon",
	// "overdue_keys", on a partitioned table "no_current_partition",
	// "few_partitions_ahead", and with CheckOptions.RequireSynchronous
	// "not_synchronous".
	Check string
	// What happened, with the numbers.
	What string
	// Action is what an operator should do about it.
	Action string
}

// CheckOptions configures Check. The zero value of every field means its
// documented default.
type CheckOptions struct {
	// Table is the idempotency table, "" for idem.DefaultTable; a name as
	// idem.Options.Table takes it.
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

	// RequireSynchronous makes commits that do not wait for a synchronous
	// standby (Durability.Synchronous false) a critical finding,
	// "not_synchronous", instead of information: for a deployment whose
	// events must survive a failover, so that the alarm fires while a new
	// primary runs without its standby.
	RequireSynchronous bool
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
	Key       idem.Key
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
	// RequireSynchronous is CheckOptions.RequireSynchronous.
	RequireSynchronous bool

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
	// checked server: information, a finding only with RequireSynchronous.
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
// (warning); claim sessions the checking role may not see (warning); with
// RequireSynchronous, commits that wait for no synchronous standby
// (critical).
func Check(ctx context.Context, db *sql.DB, opts CheckOptions) (*Report, error) {
	t, err := catalog.ParseTable(opts.Table)
	if err != nil {
		return nil, err
	}
	r := &Report{
		Table:        t.Name,
		Horizon:      orDefault(opts.Horizon, DefaultHorizon),
		Retention:    orDefault(opts.Retention, DefaultRetention),
		StuckAfter:   orDefault(opts.StuckAfter, DefaultStuckAfter),
		OverdueGrace: orDefault(opts.OverdueGrace, DefaultOverdueGrace),

		RequireSynchronous: opts.RequireSynchronous,
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
		distributed, err := existing(ctx, tx, t)
		if err != nil {
			return err
		}
		overdueBefore, err := r.PartitionReport.read(ctx, tx, t, r.Retention+r.OverdueGrace)
		if err != nil {
			return err
		}
		var oldest sql.NullTime
		// The counts, then the sizes in a statement of their own: Citus
		// runs no subquery in the target list of an aggregate over a
		// distributed table.
		err = tx.QueryRowContext(ctx, `SELECT now(), count(*), min(claimed_at),
       count(*) FILTER (WHERE claimed_at < coalesce($2::timestamptz, now() - $1::bigint * interval '1 microsecond')),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until IS NULL),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until >= now()),
       count(*) FILTER (WHERE completed_at IS NULL AND lease_until < now())
FROM `+t.Quoted, (r.Retention+r.OverdueGrace).Microseconds(), overdueBefore).
			Scan(&r.CheckedAt, &r.Rows, &oldest, &r.OverdueRows, &r.Unanswered, &r.LiveLeases, &r.ExpiredLeases)
		if err != nil {
			return err
		}
		if r.TableBytes, r.Deleted, err = sizes(ctx, tx, t, distributed); err != nil {
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
		claims, err := inFlightClaims(ctx, tx, t, distributed)
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
		return nil, fmt.Errorf("idem: check %s: %w", t.Name, err)
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
	if r.RequireSynchronous && !r.Durability.Synchronous() {
		add(SeverityCritical, "not_synchronous",
			"commits do not wait for a synchronous standby: "+r.Durability.Summary,
			"Bring a synchronous standby back. After a failover the new primary runs without one until the old primary rejoins or a new standby is added (pg_auto_failover: the node is in wait_primary; see docs/ha.md); until then events answered 2xx would be lost by another failover. If the server's synchronous_standby_names is set and no standby confirms, commits wait: start the standby. A managed service that replicates below PostgreSQL cannot pass this check: run it without -require-synchronous there.")
	}
	out = append(out, partitionFindings(r)...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].Severity > out[j].Severity })
	return out
}

func describeKeys(keys []UnansweredKey) string {
	k := keys[0].Key
	return strconv.Quote(k.Source) + "/" + strconv.Quote(k.EventID)
}
