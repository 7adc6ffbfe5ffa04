// Command demo shows in under a minute what idem is for. It starts an
// orders receiver on loopback whose handler appends a row to a ledger table
// (a write that would show a second run) and fires a retry storm at it: every
// event is delivered several times at once, some originals are slow enough
// that duplicates find them in flight and get 409 (and retry, as a provider
// would), and a few deliveries reuse an event id with a different body. Then
// it counts, in the database, the ledger rows of every event, compares every
// replay with its original, and prints a verdict. The exit status is 1 when
// the verdict fails.
//
//	go run ./demo
//	go run ./demo -events 500 -deliveries 10
//	go run ./demo -no-idem     # the same storm without the middleware
//
// Each run uses a schema of its own, idem_demo_<time>_<random>, dropped at
// the end (kept with -keep).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pgidem/idem/examples/internal/example"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// config is what the flags set.
type config struct {
	events      int
	deliveries  int
	concurrency int
	databaseURL string
	slowEvery   int           // every slowEvery-th event's handler is slow; 0: none
	slowFor     time.Duration // how slow
	reuseEvery  int           // every reuseEvery-th event gets a delivery with another body; 0: none
	lockWait    time.Duration
	keep        bool
	noIdem      bool
}

const usageText = `Usage: go run ./demo [flags]

Starts an orders receiver on 127.0.0.1 behind the idem middleware and fires
a retry storm at it: each of -events events is delivered -deliveries times at
once, with at most -concurrency requests in flight. One event in %d has a slow
handler (%v), so that its duplicates wait, get 409 and retry after
Retry-After; one in %d is also delivered once with the same id and another
body, which must get 422. Then it checks in the database that every event
wrote exactly one ledger row and that every replay is identical to its
original, prints a summary, and exits 1 if that verdict fails.

Flags:
`

// parseFlags reads args; ok is false when the program should stop, with
// the exit code.
func parseFlags(args []string, stderr io.Writer) (cfg config, code int, ok bool) {
	cfg = config{slowEvery: 20, slowFor: 600 * time.Millisecond, reuseEvery: 25, lockWait: 200 * time.Millisecond}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&cfg.events, "events", 200, "number of distinct events (N)")
	fs.IntVar(&cfg.deliveries, "deliveries", 5, "deliveries of each event, sent at the same time (M)")
	fs.IntVar(&cfg.concurrency, "concurrency", 32, "most requests in flight at once")
	fs.StringVar(&cfg.databaseURL, "database-url", "", example.DatabaseURLUsage)
	fs.BoolVar(&cfg.keep, "keep", false, "keep this run's schema and its tables for inspection instead of dropping them")
	fs.BoolVar(&cfg.noIdem, "no-idem", false, "run the storm against the bare handler, without the middleware: see the verdict fail")
	fs.Usage = func() {
		fmt.Fprintf(stderr, usageText, cfg.slowEvery, cfg.slowFor, cfg.reuseEvery)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cfg, 0, false
		}
		return cfg, 2, false
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "demo: unexpected argument %q (see -h)\n", fs.Arg(0))
		return cfg, 2, false
	case cfg.events < 1 || cfg.deliveries < 1 || cfg.concurrency < 1:
		fmt.Fprintln(stderr, "demo: -events, -deliveries and -concurrency must be at least 1")
		return cfg, 2, false
	}
	if cfg.databaseURL == "" {
		cfg.databaseURL = example.DatabaseURL()
	}
	return cfg, 0, true
}

// run is the whole program; it returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, code, ok := parseFlags(args, stderr)
	if !ok {
		return code
	}
	db, err := example.OpenDB(ctx, cfg.databaseURL)
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 1
	}
	defer db.Close()

	rcv, err := startReceiver(ctx, db, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "demo:", example.OneLine(err))
		return 1
	}
	defer func() {
		if err := rcv.close(cfg.keep); err != nil {
			fmt.Fprintln(stderr, "demo: cleaning up:", example.OneLine(err))
		}
	}()
	mode := "behind the idem middleware"
	if cfg.noIdem {
		mode = "WITHOUT the idem middleware (-no-idem)"
	}
	fmt.Fprintf(stdout, "Orders receiver on %s, %s; tables in schema %s.\n", rcv.url, mode, rcv.schema)
	fmt.Fprintf(stdout, "Firing %d events × %d deliveries, at most %d at a time…\n", cfg.events, cfg.deliveries, cfg.concurrency)

	st := newStorm(cfg, rcv.url)
	res := st.run(ctx, newProgress(stderr, st))
	if ctx.Err() != nil {
		fmt.Fprintln(stderr, "demo: interrupted")
		return 1
	}
	v, err := judge(ctx, db, rcv, st)
	if err != nil {
		fmt.Fprintln(stderr, "demo: reading the ledger:", example.OneLine(err))
		return 1
	}
	report(stdout, cfg, rcv, res, v)
	if !v.pass() {
		return 1
	}
	return 0
}
