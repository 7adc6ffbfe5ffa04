package idemnats_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/stretchr/testify/require"
)

// BenchmarkConsume: messages consumed from a JetStream stream by a
// durable consumer's Consume callback, one at a time, each appending one
// ledger row: through idemnats (the claim, the row and the stored outcome
// in one transaction, acked after COMMIT) against the same row written by
// hand in a transaction of the callback's own and acked after its COMMIT
// (byhand), on each adapter. The messages are published before the timer
// starts. Interleave the variants by running the command several times:
//
//	for i in 1 2 3 4 5 6; do go test -run '^$' -bench Consume -benchtime 400x ./idemnats; done
func BenchmarkConsume(b *testing.B) {
	for _, adapter := range adapters {
		for _, variant := range []string{"byhand", "idemnats"} {
			b.Run(fmt.Sprintf("%s/%s", pgxOrSQL(adapter), variant), func(b *testing.B) {
				w := newWorld(b, adapter, idem.Options{})
				cons := w.consumer(jetstream.ConsumerConfig{Durable: "bench", AckWait: 30e9})
				futures := make([]jetstream.PubAckFuture, b.N)
				for i := range b.N {
					m := nats.NewMsg(w.subject)
					m.Data = fmt.Appendf(nil, `{"account":"acme","amount":%d}`, i)
					m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("bench-%d", i))
					f, err := js.PublishMsgAsync(m)
					require.NoError(b, err)
					futures[i] = f
				}
				for _, f := range futures {
					select {
					case <-f.Ok():
					case err := <-f.Err():
						b.Fatal(err)
					}
				}
				handle := w.byHand(b)
				if variant == "idemnats" {
					handle = w.handler(cons, func(ctx context.Context, msg jetstream.Msg) error {
						key, _ := idem.KeyFromContext(ctx)
						return ledgerWrite(ctx, w.ledger, key.EventID, msg.Data())
					}).Handle
				}
				done := make(chan struct{})
				n := 0
				b.ReportAllocs()
				b.ResetTimer()
				cc, err := cons.Consume(func(msg jetstream.Msg) {
					handle(msg)
					if n++; n == b.N {
						close(done)
					}
				})
				require.NoError(b, err)
				<-done
				b.StopTimer()
				cc.Stop()
				<-cc.Closed()
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msg/s")
				require.Equal(b, b.N, w.count(w.ledger, ""))
			})
		}
	}
}

// byHand is the benchmark's baseline: the ledger row in a transaction of
// the callback's own, on the world's adapter, and an ack after its COMMIT.
func (w *world) byHand(b *testing.B) func(msg jetstream.Msg) {
	q := `INSERT INTO ` + w.ledger + ` (event, body) VALUES ($1, $2)`
	return func(msg jetstream.Msg) {
		ctx := context.Background()
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		if w.pool != nil {
			tx, err := w.pool.Begin(ctx)
			if err == nil {
				if _, err = tx.Exec(ctx, q, id, string(msg.Data())); err == nil {
					err = tx.Commit(ctx)
				}
				_ = tx.Rollback(ctx)
			}
			if err != nil {
				b.Error(err)
				return
			}
		} else {
			tx, err := db.BeginTx(ctx, nil)
			if err == nil {
				if _, err = tx.ExecContext(ctx, q, id, string(msg.Data())); err == nil {
					err = tx.Commit()
				}
				_ = tx.Rollback()
			}
			if err != nil {
				b.Error(err)
				return
			}
		}
		if err := msg.Ack(); err != nil {
			b.Error(err)
		}
	}
}

func pgxOrSQL(adapter string) string {
	if adapter == "pgx" {
		return "pgx"
	}
	return "sql"
}
