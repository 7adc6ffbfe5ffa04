package idem_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/benchref"
)

// BenchmarkDoNewEvent: Middleware.Do for keys never seen before, beside the
// same transaction written by hand ("inline": BEGIN; INSERT the key ... ON
// CONFLICT DO NOTHING; the ledger write; UPDATE the key with the value;
// COMMIT), on database/sql, with benchSenders callers and a pool of
// benchPool connections, as the HTTP benchmarks. No HTTP at all: a queue
// consumer's work per message.
func BenchmarkDoNewEvent(b *testing.B) {
	for _, impl := range []string{"do", "inline"} {
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
			b.ReportMetric(float64(w.count.n.Load()-before)/float64(b.N), "stmts/op")
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
		q := `"` + w.table + `"`
		claim := `INSERT INTO ` + q + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING RETURNING 1`
		complete := `UPDATE ` + q + `
SET response_status = 200, response_headers = '{}', response_body = $3, completed_at = now()
WHERE source = $1 AND event_id = $2`
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
	b.Fatalf("unknown impl %q", impl)
	return nil
}
