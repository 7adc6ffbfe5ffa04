// Command sweepcost measures what removing expired keys costs: the sweep of
// a plain table (DELETE in batches) against the sweep of a partitioned one
// (the partitions that hold the expired keys detached and dropped), in WAL
// bytes and time, for each -keys count. It is run by hand, not by CI: a
// million keys take minutes to write.
//
// Each measurement gets a fresh table with the expired keys (claimed 31 to
// 40 days ago, spread over 10 days) and 10,000 live ones (claimed today),
// then a CHECKPOINT, so that the sweep's first change to each page writes
// the page in full, as it does in production, where expired keys were
// written weeks and many checkpoints ago. The WAL is
// pg_current_wal_lsn() before and after: the whole server's, so other
// sessions' writes are counted too; the rounds take turns (plain, then
// partitioned), and the least of each is reported, since other writes
// only ever add.
//
//	go run ./cmd/sweepcost                           # 100k and 1M keys, 3 rounds
//	go run ./cmd/sweepcost -keys 100000 -rounds 1
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/internal/testdb"
)

type result struct {
	removed int64
	wal     int64
	took    time.Duration
}

func main() {
	keys := flag.String("keys", "100000,1000000", "comma-separated counts of expired keys")
	rounds := flag.Int("rounds", 3, "measurements of each layout per count, taking turns")
	flag.Parse()
	if err := run(*keys, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "sweepcost:", err)
		os.Exit(1)
	}
}

func run(keyList string, rounds int) error {
	url, name, err := testdb.Create("idem_sweepcost")
	if err != nil {
		return err
	}
	defer func() { _ = testdb.Drop(name) }()
	db, err := sql.Open("pgx", url)
	if err != nil {
		return err
	}
	defer db.Close()
	ctx := context.Background()
	fmt.Println("| expired keys | sweep | keys removed | WAL | time |")
	fmt.Println("|---:|---|---:|---:|---:|")
	for _, k := range strings.Split(keyList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(k))
		if err != nil || n <= 0 {
			return fmt.Errorf("-keys: %q is not a positive count", k)
		}
		best := map[string]result{}
		for r := 0; r < rounds; r++ {
			for _, layout := range []string{"DELETE (plain table)", "DROP (partitioned table)"} {
				res, err := measure(ctx, db, fmt.Sprintf("cost_%d_%d_%d", n, r, len(layout)), n, strings.HasPrefix(layout, "DROP"))
				if err != nil {
					return fmt.Errorf("%d keys, %s: %w", n, layout, err)
				}
				if res.removed != int64(n) {
					return fmt.Errorf("%d keys, %s: removed %d", n, layout, res.removed)
				}
				fmt.Fprintf(os.Stderr, "round %d, %d keys, %s: %d WAL bytes, %v\n", r+1, n, layout, res.wal, res.took)
				b, ok := best[layout]
				if !ok || res.wal < b.wal {
					b.wal = res.wal
				}
				if !ok || res.took < b.took {
					b.took = res.took
				}
				b.removed = res.removed
				best[layout] = b
			}
		}
		for _, layout := range []string{"DELETE (plain table)", "DROP (partitioned table)"} {
			b := best[layout]
			fmt.Printf("| %d | %s | %d | %s | %v |\n", n, layout, b.removed, mib(b.wal), b.took.Round(time.Millisecond))
		}
		del, drop := best["DELETE (plain table)"], best["DROP (partitioned table)"]
		fmt.Printf("| %d | DROP / DELETE | | 1/%.0f | 1/%.0f |\n", n, float64(del.wal)/float64(max(drop.wal, 1)), float64(del.took)/float64(max(drop.took, 1)))
	}
	return nil
}

// measure makes a table with n expired keys and 10,000 live ones, and
// sweeps it with a 30-day retention.
func measure(ctx context.Context, db *sql.DB, table string, n int, partitioned bool) (result, error) {
	var interval time.Duration
	if partitioned {
		interval = 24 * time.Hour
	}
	if err := idem.MigrateWith(ctx, db, idem.MigrateOptions{Table: table, PartitionInterval: interval}); err != nil {
		return result{}, err
	}
	defer func() { _, _ = db.ExecContext(ctx, `DROP TABLE IF EXISTS "`+table+`"`) }()
	var stmts []string
	if partitioned {
		for d := 31; d <= 41; d++ { // days 31 to 40 back, and the 41st for the edge
			p := fmt.Sprintf(`"%s_d%d"`, table, d)
			stmts = append(stmts,
				`CREATE TABLE `+p+` (LIKE "`+table+`" INCLUDING DEFAULTS)`,
				`ALTER TABLE `+p+` ADD PRIMARY KEY (source, event_id)`,
				fmt.Sprintf(`ALTER TABLE "%s" ATTACH PARTITION %s FOR VALUES
FROM (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '%d days')
TO (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '%d days')`, table, p, d, d-1))
		}
	}
	stmts = append(stmts,
		fmt.Sprintf(`INSERT INTO "%s" (source, event_id, payload_digest, response_status, response_headers,
    response_body, claimed_at, completed_at)
SELECT 'stripe', 'evt_' || md5(g::text), sha256(g::text::bytea), 200, '{"Content-Type": ["application/json"]}',
       convert_to('{"status":"recorded","id":' || g || '}', 'UTF8'),
       date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '31 days'
         - (g %% 10) * interval '1 day' + (g / 10) * interval '1 millisecond', now()
FROM generate_series(1, %d) AS g`, table, n),
		fmt.Sprintf(`INSERT INTO "%s" (source, event_id, payload_digest, response_status, response_body, completed_at)
SELECT 'stripe', 'live_' || g, sha256(g::text::bytea), 200, '\x00', now() FROM generate_series(1, 10000) AS g`, table),
		`VACUUM ANALYZE "`+table+`"`,
		`CHECKPOINT`)
	for _, s := range stmts {
		if _, err := db.ExecContext(ctx, s); err != nil {
			return result{}, fmt.Errorf("%s: %w", s, err)
		}
	}
	var before string
	if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&before); err != nil {
		return result{}, err
	}
	res, err := idemops.Sweep(ctx, db, idemops.SweepOptions{
		Table: table, Retention: 30 * 24 * time.Hour, Pause: -1,
		BatchSize: idemops.DefaultSweepBatch, MaxBatches: n/idemops.DefaultSweepBatch + 2,
	})
	if err != nil {
		return result{}, err
	}
	if res.Capped {
		return result{}, errors.New("the sweep stopped at its batch cap")
	}
	var wal int64
	if err := db.QueryRowContext(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint`, before).Scan(&wal); err != nil {
		return result{}, err
	}
	return result{removed: res.Removed, wal: wal, took: res.Duration}, nil
}

func mib(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%.1f KiB", float64(n)/1024)
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
