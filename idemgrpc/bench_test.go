package idemgrpc_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// BenchmarkPay: a new key's call of Pay over gRPC on loopback, through
// the interceptor and idem's claim (idem), against the same handler
// writing its row in a transaction of its own, without idem (byhand), on
// each adapter; sequential calls, and 8 clients at once. Each call appends
// one ledger row. docs/performance.md has the figures. Run it with
//
//	go test -run '^$' -bench Pay -count 6 ./idemgrpc   # then benchstat
func BenchmarkPay(b *testing.B) {
	for _, adapter := range adapters {
		for _, variant := range []string{"byhand", "idem"} {
			for _, clients := range []int{1, 8} {
				name := fmt.Sprintf("%s/%s/clients=%d", pgxOrSQL(adapter), variant, clients)
				b.Run(name, func(b *testing.B) {
					w := newWorld(b, adapter, setup{bare: variant == "byhand"})
					if variant == "byhand" {
						w.handle = w.writeByHand
					}
					run := fmt.Sprintf("r%d", seq.Add(1))
					// One call before the clock starts: the pool's first
					// connections and the middleware's first claim (which
					// reads the table's layout) are not what is measured.
					if c := w.payKey(req("bench", 1), run+"-warm"); c.err != nil {
						b.Fatal(c.err)
					}
					b.ReportAllocs()
					b.ResetTimer()
					if clients == 1 {
						for i := 0; b.Loop(); i++ {
							if c := w.payKey(req("bench", 1), fmt.Sprintf("%s-%d", run, i)); c.err != nil {
								b.Fatal(c.err)
							}
						}
						return
					}
					b.SetParallelism(clients / 2) // GOMAXPROCS is 2 on the project's machine
					var n int64
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							k := fmt.Sprintf("%s-%d", run, atomicAdd(&n))
							if c := w.payKey(req("bench", 1), k); c.err != nil {
								b.Error(c.err)
								return
							}
						}
					})
				})
			}
		}
	}
}

func pgxOrSQL(adapter string) string {
	if adapter == "pgx" {
		return "pgx"
	}
	return "sql"
}

// writeByHand is write in a transaction of the handler's own: what the
// handler does without idem.
func (w *world) writeByHand(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
	q := `INSERT INTO ` + w.ledger + ` (account, amount) VALUES ($1, $2) RETURNING id`
	var id int64
	if w.pool != nil {
		tx, err := w.pool.Begin(ctx)
		if err != nil {
			return nil, status.Error(codes.Unavailable, "begin failed")
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := tx.QueryRow(ctx, q, r.Account, r.Amount).Scan(&id); err != nil {
			return nil, status.Error(codes.Internal, "write failed")
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, status.Error(codes.Unavailable, "commit failed")
		}
	} else {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, status.Error(codes.Unavailable, "begin failed")
		}
		defer func() { _ = tx.Rollback() }()
		if err := tx.QueryRowContext(ctx, q, r.Account, r.Amount).Scan(&id); err != nil {
			return nil, status.Error(codes.Internal, "write failed")
		}
		if err := tx.Commit(); err != nil {
			return nil, status.Error(codes.Unavailable, "commit failed")
		}
	}
	return &testpb.PayReply{Entry: id, Account: r.Account, Amount: r.Amount, Labels: r.Labels}, nil
}

func atomicAdd(n *int64) int64 { return atomic.AddInt64(n, 1) }
