package idem_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/benchref"
)

// BenchmarkDoNewEvent: Middleware.Do for keys never seen before, beside the
// same transaction written by hand ("inline": BEGIN; INSERT the key ... ON
// CONFLICT DO NOTHING; the ledger write; UPDATE the key with the value;
// COMMIT), on database/sql and on pgx (idempgx; the hand-written one
// through pgx's own Begin and Commit), with benchSenders callers and a pool
// of benchPool connections, as the HTTP benchmarks. No HTTP at all: a queue
// consumer's work per message. stmts/op is counted on database/sql only.
func BenchmarkDoNewEvent(b *testing.B) {
	for _, impl := range []string{"inline", "do", "inline-pgx", "do-pgx"} {
		b.Run("impl="+impl, func(b *testing.B) {
			w := newBenchWorld(b)
			call := w.doImpl(b, impl)
			prefix := fmt.Sprintf("do-%d-", benchRun.Add(1))
			b.ReportAllocs()
			b.SetParallelism(max(1, benchSenders/runtime.GOMAXPROCS(0)))
			var seq atomic.Int64
			before := w.count.n.Load()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					id := prefix + strconv.FormatInt(seq.Add(1), 10)
					if err := call(context.Background(), id, benchBody(id)); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			if !strings.HasSuffix(impl, "-pgx") {
				b.ReportMetric(float64(w.count.n.Load()-before)/float64(b.N), "stmts/op")
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
		})
	}
}

// doImpl returns the impl's handling of one message.
func (w *benchWorld) doImpl(b *testing.B, impl string) func(ctx context.Context, id string, body []byte) error {
	ledger := w.ledger
	write := func(ctx context.Context, tx *sql.Tx, id string, body []byte) ([]byte, error) {
		n, err := benchref.LedgerInsert(ctx, tx, ledger, id, body)
		return benchref.Answer(n, id), err
	}
	switch impl {
	case "do":
		mw := w.middleware(b, idem.Options{})
		return func(ctx context.Context, id string, body []byte) error {
			_, err := mw.Do(ctx, idem.Key{Source: benchSource, EventID: id}, body, func(ctx context.Context) ([]byte, error) {
				tx, _ := idem.Tx(ctx)
				return write(ctx, tx, id, body)
			})
			return err
		}
	case "inline":
		claim, complete := benchref.InlineDoSQL(w.table)
		return func(ctx context.Context, id string, body []byte) error {
			digest := sha256.Sum256(body)
			tx, err := w.db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			var one int
			if err := tx.QueryRowContext(ctx, claim, benchSource, id, digest[:]).Scan(&one); err != nil {
				return err // a new key every time: a duplicate is an error here
			}
			value, err := write(ctx, tx, id, body)
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, complete, benchSource, id, value); err != nil {
				return err
			}
			return tx.Commit()
		}
	}
	pool := w.pgxPool(b)
	writePgx := func(ctx context.Context, tx pgx.Tx, id string, body []byte) ([]byte, error) {
		n, err := benchref.LedgerInsertPgx(ctx, tx, ledger, id, body)
		return benchref.Answer(n, id), err
	}
	switch impl {
	case "do-pgx":
		mw, err := idempgx.New(pool, idem.Options{Table: w.table})
		if err != nil {
			b.Fatal(err)
		}
		return func(ctx context.Context, id string, body []byte) error {
			_, err := mw.Do(ctx, idem.Key{Source: benchSource, EventID: id}, body, func(ctx context.Context) ([]byte, error) {
				tx, _ := idempgx.Tx(ctx)
				return writePgx(ctx, tx, id, body)
			})
			return err
		}
	case "inline-pgx":
		claim, complete := benchref.InlineDoSQL(w.table)
		return func(ctx context.Context, id string, body []byte) error {
			digest := sha256.Sum256(body)
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			var one int
			if err := tx.QueryRow(ctx, claim, benchSource, id, digest[:]).Scan(&one); err != nil {
				return err
			}
			value, err := writePgx(ctx, tx, id, body)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, complete, benchSource, id, value); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	b.Fatalf("unknown impl %q", impl)
	return nil
}

// pgxPool is a pgx pool of benchPool connections on the world's database,
// closed when b ends.
func (w *benchWorld) pgxPool(b *testing.B) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(idem.TestDatabaseURL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = benchPool
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}
