// Command idem operates an idem idempotency table, from a shell, a cron job
// or a Kubernetes CronJob:
//
//	idem migrate                         create or update the table; says which it did
//	idem migrate -partition-interval 24h create it partitioned by day (docs/partitioning.md)
//	idem migrate -distribute             on Citus: then distribute it by event_id (docs/citus.md)
//	idem sweep -retention 720h -batch 5000   delete expired keys, one bounded run
//	idem check -horizon 72h              health report; exit 0 ok, 1 warning, 2 critical
//	idem check -require-synchronous      and critical while commits wait for no synchronous standby
//	idem stats                           keys by source, completed and in flight
//	idem keys show -source S -id ID      one key: state, times, stored answer
//	idem keys list -state stuck          keys in a state, newest first
//	idem keys forget -source S -id ID    delete one key so its next delivery runs again
//	idem version                         the module version and VCS revision of this build
//
// Every command but version takes -database-url (default: $DATABASE_URL)
// and -table (default: webhook_idempotency); idem <command> -h lists its
// flags. check, stats and keys take -json for a JSON document on stdout
// instead of the text report (docs/operations.md describes it).
//
// Exit codes: 0 success (check: healthy); 1 check found warnings; 2 check
// found critical problems; 3 the command failed (bad usage, database
// unreachable, SQL error), with a one-line error on stderr; 4 keys show or
// keys forget found no such key; 5 keys forget refused a key in flight or
// under a live lease.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/internal/connstr"
	"github.com/pgidem/idem/internal/migration"
)

// Exit codes.
const (
	exitOK       = 0
	exitWarning  = 1 // check: warnings
	exitCritical = 2 // check: critical findings
	exitFailed   = 3 // the command could not do its job
	// exitNotFound and exitRefused are in keys.go.
)

const usage = `idem operates an idem idempotency table (https://github.com/pgidem/idem).

Usage: idem <command> [flags]

Commands:
  migrate   create the table and its index if missing (safe to run again)
  sweep     delete expired keys in bounded batches: one run, then exit
  check     report the table's health; the exit code says how bad
  stats     count keys by source, completed and in flight
  keys show -source S -id ID       one key: state, times, stored answer (-body to print it)
  keys list -state stuck           keys by state (unanswered, stuck, leased, expired, all), newest first
  keys forget -source S -id ID     delete a key so its next delivery runs the handler
  version   print the module version and VCS revision of this build

Every command but version takes -database-url (default: $DATABASE_URL) and
-table (default: webhook_idempotency); check, stats and keys take -json.
Run idem <command> -h for its flags.

Exit codes:
  0  success; for check: healthy
  1  check found warnings
  2  check found critical problems
  3  the command failed: bad usage, database unreachable, SQL error
     (a one-line error on stderr)
  4  keys show, keys forget: no such key
  5  keys forget: refused (in flight or under a live lease; -force overrides)
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// command is one subcommand: its flags and what it does with them.
type command struct {
	name, summary string
	flags         func(fs *flag.FlagSet) func(ctx context.Context, db *sql.DB, table string, stdout, stderr io.Writer) (int, error)
}

var commands = []command{
	{"migrate", "create the table and its index if missing (safe to run again)", migrateFlags},
	{"sweep", "delete keys older than -retention in bounded batches, one run", sweepFlags},
	{"check", "report the table's health; exit 0 healthy, 1 warning, 2 critical", checkFlags},
	{"stats", "count keys by source, completed and in flight", statsFlags},
	{"keys show", "show one key: its state, times and stored answer; exit 4 when there is none", keysShowFlags},
	{"keys list", "list the keys in a state, newest first", keysListFlags},
	{"keys forget", "delete one key so that its next delivery runs the handler; exit 4 not found, 5 refused", keysForgetFlags},
}

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "idem: missing command (migrate, sweep, check, stats, keys or version); see idem -h")
		return exitFailed
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	case "version", "-version", "--version":
		if len(args) == 2 && (args[1] == "-h" || args[1] == "-help" || args[1] == "--help") {
			fmt.Fprint(stdout, "Usage: idem version\n\nPrint the module version of this build and, when the build recorded it, the VCS revision.\n")
			return exitOK
		}
		if len(args) > 1 {
			fmt.Fprintf(stderr, "idem version: unexpected argument %q\n", args[1])
			return exitFailed
		}
		bi, _ := debug.ReadBuildInfo()
		fmt.Fprint(stdout, versionText(bi))
		return exitOK
	}
	if args[0] == "keys" {
		if len(args) < 2 || strings.HasPrefix(args[1], "-") {
			fmt.Fprintln(stderr, "idem keys: missing subcommand (show, list or forget); see idem -h")
			return exitFailed
		}
		args = append([]string{"keys " + args[1]}, args[2:]...)
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == args[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		fmt.Fprintf(stderr, "idem: unknown command %q (migrate, sweep, check, stats, keys or version); see idem -h\n", args[0])
		return exitFailed
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "idem %s: %s\n", cmd.name, oneLine(err))
		return exitFailed
	}

	fs := flag.NewFlagSet("idem "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported in one line below
	dbURL := fs.String("database-url", "", "PostgreSQL URL, as pgx takes it (default: $DATABASE_URL)")
	table := fs.String("table", idem.DefaultTable, `the idempotency table, "name" or "schema.name", each part of a-z, 0-9 and _`)
	exec := cmd.flags(fs)
	fs.Usage = func() {} // Parse calls it on errors too; -h is handled below
	switch err := fs.Parse(args[1:]); {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "Usage: idem %s [flags]\n\n%s.\n\nFlags:\n", cmd.name, capitalize(cmd.summary))
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		fmt.Fprint(stdout, "\nExit codes: 0 success (check: healthy), 1 check: warnings, 2 check: critical, 3 failed, 4 keys: not found, 5 keys forget: refused.\n")
		return exitOK
	case err != nil:
		return fail(fmt.Errorf("%w (see idem %s -h)", err, cmd.name))
	case fs.NArg() > 0:
		return fail(fmt.Errorf("unexpected argument %q (see idem %s -h)", fs.Arg(0), cmd.name))
	}
	if *dbURL == "" {
		*dbURL = os.Getenv("DATABASE_URL")
	}
	if *dbURL == "" {
		return fail(errors.New("no database: set -database-url or DATABASE_URL"))
	}
	if cfg, err := pgconn.ParseConfig(*dbURL); err == nil { // a bad URL: sql.Open or the ping says why
		if w := connstr.Warning(cfg); w != "" {
			fmt.Fprintf(stderr, "idem %s: warning: %s\n", cmd.name, strings.TrimPrefix(w, "idem: "))
		}
	}
	db, err := sql.Open("pgx", *dbURL)
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(2)
	if err := db.PingContext(ctx); err != nil {
		return fail(fmt.Errorf("connect: %w", err))
	}
	code, err := exec(ctx, db, *table, stdout, stderr)
	if err != nil {
		return fail(err)
	}
	return code
}

func migrateFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	interval := fs.Duration("partition-interval", 0, "create the table range-partitioned on claimed_at, one partition per interval (whole hours; 24h: one per UTC day); on a partitioned table, the interval of the partitions added from now on (default: that of its newest partition)")
	ahead := fs.Int("partitions-ahead", idem.DefaultPartitionsAhead, "on a partitioned table, the partitions kept ready after the current one")
	distribute := fs.Bool("distribute", false, "on the coordinator of a Citus cluster, then distribute the table by event_id (docs/citus.md)")
	colocate := fs.String("colocate-with", "", "with -distribute: a table distributed by the event's id whose shards the table's follow (default: Citus's default colocation group)")
	return func(ctx context.Context, db *sql.DB, table string, stdout, _ io.Writer) (int, error) {
		switch {
		case *ahead <= 0:
			return 0, errors.New("-partitions-ahead must be positive")
		case *colocate != "" && !*distribute:
			return 0, errors.New("-colocate-with needs -distribute")
		case *distribute && *interval != 0:
			return 0, errors.New("-distribute takes no -partition-interval: claims on Citus need a plain table (docs/citus.md)")
		}
		res, err := migration.Run(ctx, db, idem.MigrateOptions{Table: table, PartitionInterval: *interval, PartitionsAhead: *ahead})
		if err != nil {
			return 0, err
		}
		fmt.Fprintln(stdout, migrated(table, res))
		if *distribute {
			d, err := idemops.Distribute(ctx, db, idemops.DistributeOptions{Table: table, ColocateWith: *colocate})
			if err != nil {
				return 0, err
			}
			fmt.Fprintln(stdout, distributed(table, *colocate, d))
		}
		return exitOK, nil
	}
}

// distributed says what idem migrate -distribute did.
func distributed(table, colocate string, d idemops.DistributeResult) string {
	with := ""
	if colocate != "" {
		with = fmt.Sprintf(", colocated with %q", colocate)
	}
	if d.Distributed {
		return fmt.Sprintf("distributed table %q by event_id%s (colocation group %d)", table, with, d.ColocationID)
	}
	return fmt.Sprintf("table %q is already distributed by event_id%s (colocation group %d)", table, with, d.ColocationID)
}

// migrated says what a migration of table did.
func migrated(table string, r migration.Result) string {
	switch {
	case r.Created && r.Partitioned:
		return fmt.Sprintf("created table %q, partitioned on claimed_at, with its index and %d %s from the current one",
			table, r.PartitionsCreated, plural(r.PartitionsCreated, "partition", "partitions"))
	case r.Created:
		return fmt.Sprintf("created table %q with its index", table)
	}
	var added []string
	for _, n := range []struct {
		n         int
		one, many string
	}{
		{r.ColumnsAdded, "column", "columns"},
		{r.IndexesAdded, "index", "indexes"},
		{r.PartitionsCreated, "partition", "partitions"},
	} {
		if n.n > 0 {
			added = append(added, fmt.Sprintf("%d %s", n.n, plural(n.n, n.one, n.many)))
		}
	}
	if len(added) == 0 {
		return fmt.Sprintf("table %q is up to date", table)
	}
	return fmt.Sprintf("table %q updated: added %s", table, strings.Join(added, ", "))
}

func sweepFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	retention := fs.Duration("retention", idemops.DefaultRetention, "delete keys claimed longer ago than this; at least 72h unless -unsafe-short-retention")
	unsafe := fs.Bool("unsafe-short-retention", false, "accept a retention under 72h: a key deleted while its sender still retries runs the handler twice")
	batch := fs.Int("batch", idemops.DefaultSweepBatch, "the most keys one transaction deletes")
	maxBatches := fs.Int("max-batches", idemops.DefaultSweepMaxBatches, "the most batches of this run")
	pause := fs.Duration("pause", idemops.DefaultSweepPause, "the pause between batches (0: none)")
	ahead := fs.Int("partitions-ahead", idem.DefaultPartitionsAhead, "on a partitioned table, the partitions kept ready after the current one")
	return func(ctx context.Context, db *sql.DB, table string, stdout, _ io.Writer) (int, error) {
		opts := idemops.SweepOptions{
			Table: table, Retention: *retention, UnsafeShortRetention: *unsafe,
			BatchSize: *batch, MaxBatches: *maxBatches, Pause: *pause, PartitionsAhead: *ahead,
			Logger: slog.New(slog.DiscardHandler), // the command prints its own summary
		}
		switch {
		case *retention == 0:
			return 0, errors.New("-retention must be positive")
		case *ahead <= 0:
			return 0, errors.New("-partitions-ahead must be positive")
		case *batch == 0, *maxBatches == 0:
			return 0, errors.New("-batch and -max-batches must be positive")
		case *pause == 0:
			opts.Pause = -1 // none; 0 would mean the library's default
		}
		res, err := idemops.Sweep(ctx, db, opts)
		line := fmt.Sprintf("removed %d expired keys from %q in %d %s (retention %v, %v)",
			res.Removed, table, res.Batches, plural(res.Batches, "batch", "batches"), *retention, res.Duration.Round(time.Millisecond))
		if res.PartitionsDropped+res.PartitionsCreated > 0 || res.Batches == 0 {
			line = fmt.Sprintf("removed %d expired keys from %q by dropping %d %s, added %d ahead (retention %v, %v)",
				res.Removed, table, res.PartitionsDropped, plural(res.PartitionsDropped, "partition", "partitions"),
				res.PartitionsCreated, *retention, res.Duration.Round(time.Millisecond))
		}
		if res.Capped {
			line += fmt.Sprintf("; stopped at -max-batches %d: expired keys remain, run again or raise -batch or -max-batches", *maxBatches)
		}
		if err != nil {
			if res.Batches > 0 {
				fmt.Fprintln(stdout, line)
			}
			return 0, err
		}
		fmt.Fprintln(stdout, line)
		return exitOK, nil
	}
}

func checkFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	horizon := fs.Duration("horizon", idemops.DefaultHorizon, "the longest retry horizon of the table's senders: keys must live longer")
	retention := fs.Duration("retention", idemops.DefaultRetention, "the sweeper's -retention")
	stuck := fs.Duration("stuck-after", idemops.DefaultStuckAfter, "report claims in flight for longer than this")
	grace := fs.Duration("overdue-grace", idemops.DefaultOverdueGrace, "how long past -retention a key may live before the sweeper counts as stalled")
	requireSync := fs.Bool("require-synchronous", false, "report commits that do not wait for a synchronous standby as critical (exit 2): an alarm for the time a new primary runs without its standby after a failover (docs/ha.md)")
	asJSON := fs.Bool("json", false, "print the report as one JSON document (docs/operations.md); the exit code is the same")
	return func(ctx context.Context, db *sql.DB, table string, stdout, _ io.Writer) (int, error) {
		for name, d := range map[string]time.Duration{"-horizon": *horizon, "-retention": *retention, "-stuck-after": *stuck, "-overdue-grace": *grace} {
			if d <= 0 {
				return 0, fmt.Errorf("%s must be positive", name)
			}
		}
		r, err := idemops.Check(ctx, db, idemops.CheckOptions{
			Table: table, Horizon: *horizon, Retention: *retention, StuckAfter: *stuck, OverdueGrace: *grace,
			RequireSynchronous: *requireSync,
		})
		if err != nil {
			return 0, err
		}
		if *asJSON {
			err = writeJSON(stdout, reportJSON(r))
		} else {
			printReport(stdout, r)
		}
		if err != nil {
			return 0, err
		}
		switch r.Severity() {
		case idemops.SeverityOK:
			return exitOK, nil
		case idemops.SeverityWarning:
			return exitWarning, nil
		}
		return exitCritical, nil
	}
}

func printReport(w io.Writer, r *idemops.Report) {
	fmt.Fprintf(w, "status: %s\n", r.Severity())
	fmt.Fprintf(w, "table: %s (%s)\n", r.Table, size(r.TableBytes))
	fmt.Fprintf(w, "keys: %d\n", r.Rows)
	if r.Rows > 0 {
		fmt.Fprintf(w, "oldest key: %s (%s old; horizon %s, retention %s)\n",
			r.OldestKey.UTC().Format(time.RFC3339), age(r.OldestAge), age(r.Horizon), age(r.Retention))
	}
	fmt.Fprintf(w, "overdue keys: %d (older than the retention plus %v)\n", r.OverdueRows, r.OverdueGrace)
	if r.Partitioned {
		current := r.CurrentPartition
		if current == "" {
			current = "none"
		}
		fmt.Fprintf(w, "partitions: %d (current: %s; %d ready ahead, until %s)\n", len(r.Partitions), current, r.PartitionsAhead, stampOrNone(r.PartitionedUntil))
	}
	fmt.Fprintf(w, "keys without an answer: %d\n", r.Unanswered)
	fmt.Fprintf(w, "leases: %d live, %d expired (lease mode: handlers at work, and crashed originals awaiting a redelivery)\n", r.LiveLeases, r.ExpiredLeases)
	fmt.Fprintf(w, "claims in flight: %d (stuck: %d, in flight for longer than %v)\n", r.InFlight, len(r.Stuck), r.StuckAfter)
	switch {
	case !r.RequireSynchronous:
		fmt.Fprintf(w, "durability (information): %s\n", r.Durability.Summary)
	case r.Durability.Synchronous():
		fmt.Fprintf(w, "durability (required: synchronous): %s\n", r.Durability.Summary)
	default:
		fmt.Fprintf(w, "durability (required: synchronous, NOT MET): %s\n", r.Durability.Summary)
	}
	for _, f := range r.Findings {
		fmt.Fprintf(w, "\n%s %s: %s\n  what to do: %s\n", strings.ToUpper(f.Severity.String()), f.Check, f.What, f.Action)
		switch f.Check {
		case "stuck_claims":
			for _, c := range r.Stuck {
				fmt.Fprintf(w, "  pid %d: in flight %v, %s, application %q, client %q, last query %q\n",
					c.PID, c.Age.Round(time.Second), c.State, c.Application, c.Client, c.Query)
			}
		case "unanswered_keys":
			printKeys(w, r.UnansweredKeys)
		case "expired_leases":
			printKeys(w, r.ExpiredLeaseKeys)
		}
	}
}

func printKeys(w io.Writer, keys []idemops.UnansweredKey) {
	for _, k := range keys {
		fmt.Fprintf(w, "  source %q event_id %q, claimed %s\n", k.Key.Source, k.Key.EventID, k.ClaimedAt.UTC().Format(time.RFC3339))
	}
}

func statsFlags(fs *flag.FlagSet) func(context.Context, *sql.DB, string, io.Writer, io.Writer) (int, error) {
	sources := fs.Int("sources", 100, "list at most this many sources, the busiest first")
	asJSON := fs.Bool("json", false, "print the statistics as one JSON document (docs/operations.md)")
	return func(ctx context.Context, db *sql.DB, table string, stdout, _ io.Writer) (int, error) {
		if *sources <= 0 {
			return 0, errors.New("-sources must be positive")
		}
		s, err := idemops.Stats(ctx, db, idemops.StatsOptions{Table: table, MaxSources: *sources})
		if err != nil {
			return 0, err
		}
		if *asJSON {
			return exitOK, writeJSON(stdout, statsJSON(s))
		}
		fmt.Fprintf(stdout, "table: %s (%s)\n", s.Table, size(s.TableBytes))
		fmt.Fprintf(stdout, "keys: %d (completed %d, without an answer %d, leases live %d, leases expired %d)\n",
			s.Rows, s.Completed, s.Unanswered, s.LiveLeases, s.ExpiredLeases)
		fmt.Fprintf(stdout, "claims in flight: %d\n", s.InFlight)
		if s.Rows > 0 {
			fmt.Fprintf(stdout, "oldest key: %s\nnewest key: %s\n", stamp(s.Oldest), stamp(s.Newest))
		}
		if len(s.Partitions) > 0 {
			fmt.Fprintf(stdout, "partitions: %d (%d ready ahead)\n\n", len(s.Partitions), s.PartitionsAhead)
			tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "PARTITION\tFROM\tTO\tKEYS\tSIZE")
			for _, p := range s.Partitions {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", p.Name, stampOrNone(p.From), stampOrNone(p.To), p.Rows, size(p.Bytes))
			}
			_ = tw.Flush()
		}
		if len(s.Sources) == 0 {
			return exitOK, nil
		}
		fmt.Fprintln(stdout)
		tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SOURCE\tCOMPLETED\tWITHOUT ANSWER\tLEASES\tOLDEST\tNEWEST")
		for _, src := range s.Sources {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\t%s\n", src.Source, src.Completed, src.Unanswered, src.Leases, stamp(src.Oldest), stamp(src.Newest))
		}
		_ = tw.Flush()
		if s.OtherSources > 0 {
			fmt.Fprintf(stdout, "(and %d more sources; see -sources)\n", s.OtherSources)
		}
		return exitOK, nil
	}
}

// oneLine renders an error on one line, without the library's "idem: "
// prefix (the command's own prefix says it).
func oneLine(err error) string {
	s := strings.TrimPrefix(err.Error(), "idem: ")
	return strings.Join(strings.Fields(s), " ")
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// stampOrNone is stamp, or "-" for an unbounded partition bound.
func stampOrNone(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return stamp(t)
}

// age renders a duration in days and hours from two days up.
func age(d time.Duration) string {
	if d < 48*time.Hour {
		return d.Round(time.Second).String()
	}
	days := d / (24 * time.Hour)
	return fmt.Sprintf("%dd%dh", days, (d-days*24*time.Hour)/time.Hour)
}

// size renders a number of bytes in binary units.
func size(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}
