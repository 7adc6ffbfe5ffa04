package idemnats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/stretchr/testify/require"
)

// BenchmarkConsume: a JetStream message handled and acked, each appending
// one ledger row: through idemnats (the claim, the row and the stored
// outcome in one transaction, acked after COMMIT) against the same row
// written by hand in a transaction of its own and acked after its COMMIT
// (byhand), on each adapter. The two take turns message by message (in
// alternating order), on two streams fetched ahead, so that both meet the
// same load on a shared machine; the figures are each one's time per
// message (byhand-ns/msg, idemnats-ns/msg) and their ratio, idemnats'
// throughput over byhand's (ratio; 1 is parity):
//
//	go test -run '^$' -bench Consume -benchtime 400x -count 6 ./idemnats
func BenchmarkConsume(b *testing.B) {
	for _, adapter := range adapters {
		b.Run(pgxOrSQL(adapter), func(b *testing.B) {
			hand, idm := newWorld(b, adapter, idem.Options{}), newWorld(b, adapter, idem.Options{})
			handMsgs := fetchAhead(b, hand, b.N)
			idemMsgs := fetchAhead(b, idm, b.N)
			byHand := hand.byHand(b)
			c := idm.handler(idm.consumer(jetstream.ConsumerConfig{Durable: "bench", AckWait: time.Minute}), func(ctx context.Context, msg jetstream.Msg) error {
				key, _ := idem.KeyFromContext(ctx)
				return ledgerWrite(ctx, idm.ledger, key.EventID, msg.Data())
			})
			var handTime, idemTime time.Duration
			timed := func(d *time.Duration, f func()) {
				t0 := time.Now()
				f()
				*d += time.Since(t0)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				h := func() { byHand(handMsgs[i]) }
				m := func() { c.Handle(idemMsgs[i]) }
				if i%2 == 0 {
					timed(&handTime, h)
					timed(&idemTime, m)
				} else {
					timed(&idemTime, m)
					timed(&handTime, h)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(handTime.Nanoseconds())/float64(b.N), "byhand-ns/msg")
			b.ReportMetric(float64(idemTime.Nanoseconds())/float64(b.N), "idemnats-ns/msg")
			b.ReportMetric(float64(handTime)/float64(idemTime), "ratio")
			require.Equal(b, b.N, hand.count(hand.ledger, ""))
			require.Equal(b, b.N, idm.count(idm.ledger, ""))
		})
	}
}

// fetchAhead publishes n messages to the world's stream and fetches them
// through its durable consumer "bench", unacked.
func fetchAhead(b *testing.B, w *world, n int) []jetstream.Msg {
	cons := w.consumer(jetstream.ConsumerConfig{Durable: "bench", AckWait: time.Minute, MaxAckPending: -1})
	futures := make([]jetstream.PubAckFuture, n)
	for i := range n {
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
	msgs := make([]jetstream.Msg, 0, n)
	for len(msgs) < n {
		batch, err := cons.Fetch(min(n-len(msgs), 200), jetstream.FetchMaxWait(10*time.Second))
		require.NoError(b, err)
		for m := range batch.Messages() {
			msgs = append(msgs, m)
		}
		require.NoError(b, batch.Error())
	}
	return msgs
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
