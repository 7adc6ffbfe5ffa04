// Command idemload drives idem and its baselines with the same load and
// reports throughput, latency, allocations and round trips for each.
//
// It starts, on loopback, one receiver per kind (see -receivers): bare (the
// ledger write in a plain transaction, no idempotency), inline (the seed's
// SQL by hand), idem (the middleware), idem-nocache (the middleware with its
// replay cache off, so that every duplicate asks PostgreSQL, as one of a key
// this instance has never seen does), and, when Redis answers at -redis,
// the peer (Fiber's idempotency middleware with Redis storage); on request,
// idem-otel and idempgx-otel (the middleware with idemotel, every span
// sampled, to measure its cost). All do the
// same handler work (append a ledger row, answer its id as JSON) on pools
// of the same size under the same concurrency. Each mix (-mix) runs every
// receiver in turns, -rounds times, rotating the order (A B C, B C A, ...),
// so machine noise falls on all of them alike; the ratios come from one run.
//
// It creates its own database (idemload_<random>) through -database-url and
// drops it at the end; it fails when PostgreSQL is missing. Exit status: 0
// when every request was answered right and every idempotent receiver ran
// each event exactly once, 1 when not, 2 when it could not run.
//
//	go run ./cmd/idemload                        # a short run (about 20 s)
//	go run ./cmd/idemload -duration 30s -rounds 10 -json > result.json
package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

type config struct {
	DatabaseURL string        `json:"-"`
	Receivers   []string      `json:"receivers"`
	Mixes       []string      `json:"mixes"`
	Concurrency int           `json:"concurrency"`
	Pool        int           `json:"pool"`
	Duration    time.Duration `json:"duration_per_receiver_per_mix_ns"`
	Rounds      int           `json:"rounds"`
	Warmup      time.Duration `json:"warmup_ns"`
	Keys        int           `json:"completed_keys"`
	BodySize    int           `json:"body_bytes"`
	Cold        bool          `json:"cold"`
	Redis       string        `json:"redis"`
	JSON        bool          `json:"-"`
	Markdown    bool          `json:"-"`
	CPUProfile  string        `json:"-"`
	MemProfile  string        `json:"-"`
	KeepDB      bool          `json:"-"`
	// Citus: the run uses the Citus coordinator's database that
	// DatabaseURL names, and distributes its tables (receivers.go).
	Citus bool `json:"citus,omitempty"`
}

func main() {
	os.Exit(run())
}

func run() int {
	var (
		cfg       config
		receivers string
		mixes     string
		floors    bool
		noPeer    bool
	)
	dflt := os.Getenv("DATABASE_URL")
	if dflt == "" {
		dflt = defaultDatabaseURL
	}
	flag.StringVar(&cfg.DatabaseURL, "database-url", dflt, "PostgreSQL admin URL; the tool creates and drops its own database there (default $DATABASE_URL or the local server)")
	flag.StringVar(&receivers, "receivers", "bare,inline,idem,idem-nocache,bare-pgx,idempgx,peer", "receivers to run, in order: bare, inline, idem, idem-nocache, bare-pgx, idempgx, peer, http-floor, fiber-floor, idem-otel, idempgx-otel")
	flag.BoolVar(&floors, "floors", false, "add http-floor and fiber-floor: the HTTP stacks with no database, the ceiling of this machine")
	flag.BoolVar(&noPeer, "no-peer", false, "leave the peer out even when Redis answers")
	flag.StringVar(&mixes, "mix", "new,dup", "mixes, each run in turn: new (unique keys), dup (completed duplicates only) or a duplicate share in [0,1]")
	flag.IntVar(&cfg.Concurrency, "c", 16, "concurrent senders")
	flag.IntVar(&cfg.Pool, "pool", 8, "PostgreSQL pool size of each receiver")
	flag.DurationVar(&cfg.Duration, "duration", 2*time.Second, "measured time per receiver per mix, split over the rounds")
	flag.IntVar(&cfg.Rounds, "rounds", 2, "interleaved turns per receiver per mix")
	flag.DurationVar(&cfg.Warmup, "warmup", 300*time.Millisecond, "unmeasured load per receiver before each mix")
	flag.IntVar(&cfg.Keys, "keys", 500, "completed keys per receiver that duplicates are drawn from")
	flag.IntVar(&cfg.BodySize, "body", 1024, "request body bytes")
	flag.BoolVar(&cfg.Cold, "cold", false, "complete the duplicate keys through a second instance of each receiver, so the measured one has never seen them")
	flag.StringVar(&cfg.Redis, "redis", "127.0.0.1:6379", "Redis address for the peer")
	flag.BoolVar(&cfg.JSON, "json", false, "print the report as JSON")
	flag.BoolVar(&cfg.Markdown, "markdown", false, "print the report's tables as Markdown (for docs/performance.md)")
	render := flag.String("render", "", "do not run: print the JSON report in this file as text (or -markdown)")
	flag.StringVar(&cfg.CPUProfile, "cpuprofile", "", "write a CPU profile of the measured slots (client and receivers: use -receivers idem to isolate it)")
	flag.StringVar(&cfg.MemProfile, "memprofile", "", "write an allocation profile at the end")
	flag.BoolVar(&cfg.KeepDB, "keep-db", false, "keep the database for inspection")
	flag.BoolVar(&cfg.Citus, "citus", false, "-database-url names the database of a Citus coordinator (the citus extension created there and on the workers): run in it, its tables distributed by event_id and colocated (docs/citus.md), instead of in a database of the tool's own")
	flag.Parse()

	if *render != "" {
		return renderFile(*render, cfg.Markdown)
	}
	ms, err := parseMixes(mixes)
	if err != nil {
		return fatal(err)
	}
	for _, m := range ms {
		cfg.Mixes = append(cfg.Mixes, m.name)
	}
	switch {
	case cfg.Concurrency < 1, cfg.Pool < 1, cfg.Rounds < 1, cfg.Keys < 1, cfg.BodySize < 64:
		return fatal(errors.New("-c, -pool, -rounds and -keys must be at least 1, -body at least 64"))
	case cfg.Duration < time.Duration(cfg.Rounds)*time.Millisecond:
		return fatal(errors.New("-duration is too short for -rounds"))
	}
	kinds := splitList(receivers)
	if floors {
		kinds = append(kinds, kindHTTPFloor, kindFiberFloor)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	rep := &report{Config: cfg}
	rep.Machine = machine()

	// Our own database, dropped at the end; on Citus, the one given,
	// whose tables each receiver drops and creates again.
	dbURL := cfg.DatabaseURL
	if !cfg.Citus {
		dbName, u, err := createDatabase(ctx, cfg.DatabaseURL)
		if err != nil {
			return fatal(fmt.Errorf("PostgreSQL is required: %w", err))
		}
		dbURL = u
		if !cfg.KeepDB {
			defer dropDatabase(cfg.DatabaseURL, dbName)
		} else {
			fmt.Fprintln(os.Stderr, "idemload: keeping database", dbName)
		}
	}
	rep.Machine.PostgreSQL = serverVersion(ctx, dbURL)

	var b [4]byte
	_, _ = rand.Read(b[:])
	e := &env{dbURL: dbURL, citus: cfg.Citus, pool: cfg.Pool, conc: cfg.Concurrency, run: "idemload:" + hex.EncodeToString(b[:]) + ":"}

	// The peer only when Redis answers.
	var active []string
	for _, k := range kinds {
		if k != kindPeer {
			active = append(active, k)
			continue
		}
		switch {
		case noPeer:
			rep.PeerNote = "left out (-no-peer)"
		case !redisUp(cfg.Redis):
			rep.PeerNote = "left out: no Redis answers at " + cfg.Redis
		default:
			e.redis, err = openRedis(cfg.Redis, cfg.Concurrency)
			if err != nil {
				return fatal(err)
			}
			defer func() { // this run's keys first (they would expire anyway), then the client
				deleteRedisKeys(e.redis, e.run)
				_ = e.redis.Close()
			}()
			active = append(active, k)
			rep.Peer = true
			rep.PeerNote = peerCaveat
		}
	}
	cfg.Receivers = active
	rep.Config = cfg

	var rcs []*receiver
	defer func() {
		for _, rc := range rcs {
			rc.close()
		}
	}()
	for _, k := range active {
		rc, err := newReceiver(ctx, e, k, nil)
		if err != nil {
			return fatal(fmt.Errorf("start %s: %w", k, err))
		}
		rcs = append(rcs, rc)
	}

	// Completed keys for the duplicates.
	needDups := false
	for _, m := range ms {
		needDups = needDups || m.dupShare > 0
	}
	if needDups {
		for _, rc := range rcs {
			var seeder *receiver
			if cfg.Cold && rc.idempotent {
				seeder, err = newReceiver(ctx, e, rc.name, rc)
				if err != nil {
					return fatal(fmt.Errorf("start a second %s: %w", rc.name, err))
				}
				seeder.prefix = rc.prefix
			}
			err := seedKeys(ctx, rc, seeder, cfg.Keys, cfg.Concurrency, cfg.BodySize)
			if seeder != nil {
				seeder.close()
			}
			if err != nil {
				return fatal(err)
			}
		}
	}

	if cfg.CPUProfile != "" {
		f, err := os.Create(cfg.CPUProfile)
		if err != nil {
			return fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return fatal(err)
		}
		defer f.Close()
		defer pprof.StopCPUProfile()
	}

	per := cfg.Duration / time.Duration(cfg.Rounds)
	for mi, m := range ms {
		for _, rc := range rcs {
			rc.res = &mixResult{}
			slot(ctx, rc, m, cfg.Concurrency, cfg.BodySize, cfg.Warmup, nil, uint64(mi))
		}
		for round := 0; round < cfg.Rounds && ctx.Err() == nil; round++ {
			for i := range rcs {
				rc := rcs[(round+i)%len(rcs)]
				rc.bucket.Store(&rc.res.bucket)
				slot(ctx, rc, m, cfg.Concurrency, cfg.BodySize, per, rc.res, uint64(1000*mi+round))
				rc.bucket.Store(nil)
			}
		}
		rep.addMix(m, rcs)
	}
	if cfg.CPUProfile != "" {
		pprof.StopCPUProfile()
	}
	if ctx.Err() != nil {
		return fatal(errors.New("interrupted"))
	}
	if cfg.MemProfile != "" {
		if err := writeMemProfile(cfg.MemProfile); err != nil {
			return fatal(err)
		}
	}

	for _, rc := range rcs {
		rep.Checks = append(rep.Checks, exactlyOnce(ctx, rc))
	}
	rep.evaluate()
	switch {
	case cfg.JSON:
		rep.writeJSON(os.Stdout)
	case cfg.Markdown:
		rep.writeMarkdown(os.Stdout)
	default:
		rep.writeText(os.Stdout)
	}
	if !rep.OK {
		return 1
	}
	return 0
}

// renderFile prints a report saved with -json.
func renderFile(path string, markdown bool) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return fatal(err)
	}
	var rep report
	if err := json.Unmarshal(b, &rep); err != nil {
		return fatal(fmt.Errorf("%s: %w", path, err))
	}
	if markdown {
		rep.writeMarkdown(os.Stdout)
	} else {
		rep.writeText(os.Stdout)
	}
	return 0
}

func fatal(err error) int {
	fmt.Fprintln(os.Stderr, "idemload:", err)
	return 2
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func writeMemProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return pprof.Lookup("allocs").WriteTo(f, 0)
}

// createDatabase makes this run's database and returns its name and URL.
func createDatabase(ctx context.Context, admin string) (string, string, error) {
	db, err := sql.Open("pgx", admin)
	if err != nil {
		return "", "", err
	}
	defer db.Close()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idemload_" + hex.EncodeToString(b[:])
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := db.ExecContext(cctx, "CREATE DATABASE "+name); err != nil {
		return "", "", fmt.Errorf("create database through %s: %w", redact(admin), err)
	}
	u, err := url.Parse(admin)
	if err != nil {
		return "", "", err
	}
	u.Path = "/" + name
	return name, u.String(), nil
}

func dropDatabase(admin, name string) {
	db, err := sql.Open("pgx", admin)
	if err != nil {
		return
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := db.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
		fmt.Fprintln(os.Stderr, "idemload: drop database:", err)
	}
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "the database URL"
	}
	return u.Redacted()
}

func serverVersion(ctx context.Context, dbURL string) string {
	db, err := sql.Open("pgx", dbURL)
	if err != nil {
		return ""
	}
	defer db.Close()
	var v string
	_ = db.QueryRowContext(ctx, "SHOW server_version").Scan(&v)
	return v
}

// exactlyOnce checks in the database that an idempotent receiver ran each
// event once: one ledger row per event id, and (idem, inline) one
// completed key per ledger row.
func exactlyOnce(ctx context.Context, rc *receiver) check {
	c := check{Receiver: rc.name, OK: true}
	if !rc.idempotent || rc.db == nil {
		c.What = "not idempotent: nothing to check"
		return c
	}
	var rows, distinct int64
	if err := rc.db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT event_id) FROM `+rc.ledger).Scan(&rows, &distinct); err != nil {
		c.OK, c.What = false, err.Error()
		return c
	}
	c.What = fmt.Sprintf("%d ledger rows for %d events", rows, distinct)
	if rows != distinct {
		c.OK = false
	}
	if hasKeyTable(rc.name) {
		var keys int64
		if err := rc.db.QueryRowContext(ctx, `SELECT count(*) FROM "`+rc.keys+`" WHERE completed_at IS NOT NULL`).Scan(&keys); err != nil {
			c.OK, c.What = false, err.Error()
			return c
		}
		c.What += fmt.Sprintf(", %d completed keys", keys)
		if keys != rows {
			c.OK = false
		}
	}
	return c
}

// machine describes where the numbers were measured.
func machine() machineInfo {
	m := machineInfo{GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, CPUs: runtime.NumCPU(),
		GOMAXPROCS: runtime.GOMAXPROCS(0), Go: runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}
