package idem_test

// Claims on a partitioned table beside the same claims on a plain one
// (docs/partitioning.md, "What it costs"):
//
//	BenchmarkPartitionedTable/path={new,recent,dup}/adapter={sql,pgx}/layout={plain,daily,weekly,daily-current-only}
//
// The tables hold the same 300,000 completed keys spread over the last 30
// days: plain; daily, with a partition per day (30 of them, the current
// day's and 3 ahead); weekly, with a partition per week (5 for the 30
// days, the current week's and 3 ahead). Each middleware waits until the
// summaries of its past partitions are read before it is measured. path=new
// sends keys never seen; path=recent redelivers keys completed minutes
// before (the current partition's: the warm-up's new events); path=dup
// redelivers the old keys, spread over the 30 days. Redeliveries run with
// the replay cache off, so every one asks PostgreSQL.
// layout=daily-current-only (new events only) is not a layout idem has: the
// middleware is given the daily table's current partition as its table, so
// it claims there as on a plain table and looks in no past partition (no
// global suppression): the floor of a claim on the partitioned table. Run
// it in rounds, so that the layouts take turns on a busy machine:
//
//	COUNT=6 BENCH=PartitionedTable scripts/bench.sh

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/benchref"
)

const (
	benchPartDays = 30      // daily partitions of the past
	benchPartKeys = 300_000 // completed keys over them
)

var (
	benchPartOnce     sync.Once
	benchPartTables   map[string]string // layout -> table with its ledger "ledger_<table>"
	benchPartErr      error
	benchPartKeyCount int64 // the completed keys in each table
)

// benchPartitionWorld returns the table of the layout, made and filled once
// per test binary.
func benchPartitionWorld(b *testing.B, layout string) string {
	b.Helper()
	benchPartOnce.Do(func() {
		keys := benchPartKeys
		if f := flag.Lookup("test.benchtime"); f != nil && f.Value.String() == "1x" {
			keys = 3000 // scripts/test.sh runs every benchmark once, to keep them from rotting
		}
		benchPartKeyCount = int64(keys)
		db := idem.OpenTestDB(b)
		benchPartTables = map[string]string{
			"plain":  idem.NewPlainTable(b, db),
			"daily":  idem.NewPartitioned(b, db, 24*time.Hour),
			"weekly": idem.NewPartitioned(b, db, 7*24*time.Hour),
		}
		var stmts []string
		for layout, days := range map[string]int{"daily": 1, "weekly": 7} {
			// The partition from MINVALUE gives way to one per interval,
			// back from the first one Migrate made (at the start of the
			// current interval since the Unix epoch, a Thursday for weeks).
			p := benchPartTables[layout]
			start := fmt.Sprintf(`to_timestamp(floor(extract(epoch FROM now()) / %[1]d) * %[1]d)`, days*86400)
			stmts = append(stmts, `DROP TABLE "`+p+`_p00010101_0000"`)
			for d := 1; d*days <= benchPartDays+days-1; d++ {
				name := fmt.Sprintf(`"%s_past%d"`, p, d)
				stmts = append(stmts,
					`CREATE TABLE `+name+` (LIKE "`+p+`" INCLUDING DEFAULTS)`,
					`ALTER TABLE `+name+` ADD PRIMARY KEY (source, event_id)`,
					fmt.Sprintf(`ALTER TABLE "%s" ATTACH PARTITION %s FOR VALUES
FROM (%s - interval '%d days') TO (%s - interval '%d days')`, p, name, start, d*days, start, (d-1)*days))
			}
		}
		for _, t := range benchPartTables {
			stmts = append(stmts,
				fmt.Sprintf(`INSERT INTO "%s" (source, event_id, payload_digest, response_status, response_headers,
    response_body, claimed_at, completed_at)
SELECT 'bench', 'old-' || g, sha256(g::text::bytea), 201, '{"Content-Type": ["application/json"]}',
       '{"ledger_id": 1}', date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
         - (g %% %d + 1) * interval '1 day' + (g / %d) * interval '1 millisecond', now()
FROM generate_series(1, %d) AS g`, t, benchPartDays, benchPartDays, keys),
				`CREATE TABLE ledger_`+t+` (id bigserial PRIMARY KEY, event_id text NOT NULL, body bytea NOT NULL)`,
				`VACUUM ANALYZE "`+t+`"`)
		}
		for _, s := range stmts {
			if _, err := db.Exec(s); err != nil {
				benchPartErr = fmt.Errorf("%s: %w", s, err)
				return
			}
		}
	})
	if benchPartErr != nil {
		b.Fatal(benchPartErr)
	}
	return benchPartTables[layout]
}

// partBench is one sub-benchmark's middleware, made once and kept for
// every run of it that testing makes (b.N = 1, 100, ...), so that the run
// measured meets warm connections and statement caches, as an instance
// running for a while would.
type partBench struct {
	h      http.Handler
	count  *benchCounter // statements counted on database/sql only
	close  func()        // its pool's
	recent []string      // keys the warm-up completed
}

// newPartBench makes the middleware of a sub-benchmark; parent owns its
// pools.
func newPartBench(parent, b *testing.B, adapter, layout string) *partBench {
	var table, ledger string
	if layout == "daily-current-only" {
		daily := benchPartitionWorld(b, "daily")
		table, ledger = idem.PartitionName(daily, time.Now().UTC().Truncate(24*time.Hour)), "ledger_"+daily
	} else {
		table = benchPartitionWorld(b, layout)
		ledger = "ledger_" + table
	}
	opts := idem.Options{KeyFunc: idem.Header(benchSource, benchHeader), Table: table, ReplayCacheBytes: -1}
	var (
		pb    partBench
		mw    *idem.Middleware
		err   error
		inner = benchref.IdemHandler(ledger)
	)
	if adapter == "sql" {
		var db *sql.DB
		db, pb.count = openBenchPool(parent, nil)
		pb.close = func() { db.Close() }
		mw, err = idem.New(db, opts)
	} else {
		cfg, perr := pgxpool.ParseConfig(idem.TestDatabaseURL(b))
		if perr != nil {
			b.Fatal(perr)
		}
		cfg.MaxConns, cfg.MinConns = benchPool, benchPool
		pool, perr := pgxpool.NewWithConfig(context.Background(), cfg)
		if perr != nil {
			b.Fatal(perr)
		}
		parent.Cleanup(pool.Close)
		pb.close = pool.Close
		mw, err = idempgx.New(pool, opts)
		inner = benchref.IdemPgxHandler(ledger)
	}
	if err != nil {
		b.Fatal(err)
	}
	if layout == "daily" || layout == "weekly" {
		awaitSummaries(b, idem.SummariesOf(mw))
	}
	pb.h = mw.Handler(inner)
	// Warm up: every connection prepares the statements of the partitions
	// it meets, and PostgreSQL plans each afresh for its first uses.
	warm := benchWarmUp
	if benchPartKeyCount < benchPartKeys {
		warm = benchSenders // scripts/test.sh's single run
	}
	var wg sync.WaitGroup
	prefix := fmt.Sprintf("warm-%d-", benchRun.Add(1))
	for i := 0; i < warm; i++ {
		pb.recent = append(pb.recent, prefix+strconv.Itoa(i))
	}
	for w := 0; w < benchSenders; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			s := newBenchSender(pb.h)
			for i := w; i < warm; i += benchSenders {
				id := prefix + strconv.Itoa(i)
				s.send(id, benchBody(id))
				g := int64(i)%benchPartKeyCount + 1
				s.send("old-"+strconv.FormatInt(g, 10), []byte(strconv.FormatInt(g, 10)))
			}
		}(w)
	}
	wg.Wait()
	// Vacuumed before it is measured: the rows that earlier sub-benchmarks
	// wrote (tens of thousands into the current partition, for new events)
	// would otherwise be vacuumed by autovacuum during whichever
	// sub-benchmark runs next, whatever its layout.
	var tables []string
	for _, t := range []string{"plain", "daily", "weekly"} {
		tables = append(tables, `"`+benchPartTables[t]+`"`)
	}
	if _, err := idem.OpenTestDB(b).Exec("VACUUM ANALYZE " + strings.Join(tables, ", ")); err != nil {
		b.Fatal(err)
	}
	return &pb
}

// benchWarmUp is how many new events and redeliveries warm a middleware up.
const benchWarmUp = 2000

func BenchmarkPartitionedTable(b *testing.B) {
	built := map[string]*partBench{}
	var last *partBench // its pool is closed once the next one is made
	for _, path := range []string{"new", "recent", "dup"} {
		for _, adapter := range []string{"sql", "pgx"} {
			for _, layout := range benchLayouts() {
				if layout == "daily-current-only" && path == "dup" {
					continue
				}
				name := "path=" + path + "/adapter=" + adapter + "/layout=" + layout
				b.Run(name, func(sb *testing.B) {
					pb := built[name]
					if pb == nil {
						if last != nil {
							last.close()
						}
						pb = newPartBench(b, sb, adapter, layout)
						built[name], last = pb, pb
					}
					switch path {
					case "new":
						prefix := fmt.Sprintf("new-%d-", benchRun.Add(1))
						benchParallel(sb, pb.h, pb.count, func(s *benchSender, i int64) int {
							id := prefix + strconv.FormatInt(i, 10)
							return s.send(id, benchBody(id))
						}, http.StatusCreated)
						return
					case "recent":
						benchParallel(sb, pb.h, pb.count, func(s *benchSender, i int64) int {
							id := pb.recent[i%int64(len(pb.recent))]
							return s.send(id, benchBody(id))
						}, http.StatusCreated)
						return
					}
					// Redeliveries of the old keys, spread over every day, each
					// with the body whose digest the key was stored with.
					benchParallel(sb, pb.h, pb.count, func(s *benchSender, i int64) int {
						g := i%benchPartKeyCount + 1
						return s.send("old-"+strconv.FormatInt(g, 10), []byte(strconv.FormatInt(g, 10)))
					}, http.StatusCreated)
				})
			}
		}
	}
}

// benchLayouts are the layouts in the order of this round: rotated by
// scripts/bench.sh's BENCH_ROUND, so that no layout always runs right
// after another (after the plain table's run, say, whose inserts
// autovacuum then visits).
func benchLayouts() []string {
	l := []string{"plain", "daily", "weekly", "daily-current-only"}
	r, _ := strconv.Atoi(os.Getenv("BENCH_ROUND"))
	r %= len(l)
	return append(l[r:], l[:r]...)
}
