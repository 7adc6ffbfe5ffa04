package idemnats_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
	"github.com/stretchr/testify/require"
)

// BenchmarkConsume: a JetStream message handled and acked, each appending
// one ledger row: through idemnats (the claim, the row and the stored
// outcome in one transaction, acked after COMMIT) against three consumers
// written by hand, each acking after its COMMIT: inline, the same
// transaction with the claim's SQL written by hand (INSERT the key ... ON
// CONFLICT DO NOTHING, the row, UPDATE the key, COMMIT: a transactional
// inbox without idem, doing the same writes); byhand, the row alone in a
// transaction of its own (no deduplication at all); and do,
// Middleware.Do called by hand with the message id (idemnats without the
// module, to tell the module's own cost from the claim's); on each adapter.
// The four take turns message by message (in rotating order), on streams
// fetched ahead, so that all meet the same load on a shared machine; the
// figures are each one's time per message (inline-ns/msg, byhand-ns/msg,
// do-ns/msg, idemnats-ns/msg) and idemnats' throughput over inline's
// (ratio-inline), byhand's (ratio) and do's (ratio-do); 1 is parity:
//
//	go test -run '^$' -bench Consume -benchtime 400x -count 6 ./idemnats
func BenchmarkConsume(b *testing.B) {
	for _, adapter := range adapters {
		b.Run(pgxOrSQL(adapter), func(b *testing.B) {
			inl, hand, do, idm := newWorld(b, adapter, idem.Options{}), newWorld(b, adapter, idem.Options{}),
				newWorld(b, adapter, idem.Options{}), newWorld(b, adapter, idem.Options{})
			inlMsgs, handMsgs := fetchAhead(b, inl, b.N), fetchAhead(b, hand, b.N)
			doMsgs, idemMsgs := fetchAhead(b, do, b.N), fetchAhead(b, idm, b.N)
			write := func(w *world) idemnats.Handler {
				return func(ctx context.Context, msg jetstream.Msg) error {
					key, _ := idem.KeyFromContext(ctx)
					return ledgerWrite(ctx, w.ledger, key.EventID, msg.Data())
				}
			}
			byInline, byHand := inl.byInline(b), hand.byHand(b)
			byDo := do.byDo(b, write(do))
			c := idm.handler(idm.consumer(jetstream.ConsumerConfig{Durable: "bench", AckWait: time.Minute}), write(idm),
				idemnats.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))) // Info, as slog.Default()
			var times [4]time.Duration
			run := [4]func(i int){
				func(i int) { byInline(inlMsgs[i]) },
				func(i int) { byHand(handMsgs[i]) },
				func(i int) { byDo(doMsgs[i]) },
				func(i int) { c.Handle(idemMsgs[i]) },
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				for k := range 4 {
					v := (i + k) % 4
					t0 := time.Now()
					run[v](i)
					times[v] += time.Since(t0)
				}
			}
			b.StopTimer()
			for v, name := range []string{"inline", "byhand", "do", "idemnats"} {
				b.ReportMetric(float64(times[v].Nanoseconds())/float64(b.N), name+"-ns/msg")
			}
			b.ReportMetric(float64(times[0])/float64(times[3]), "ratio-inline")
			b.ReportMetric(float64(times[1])/float64(times[3]), "ratio")
			b.ReportMetric(float64(times[2])/float64(times[3]), "ratio-do")
			for _, w := range []*world{inl, hand, do, idm} {
				require.Equal(b, b.N, w.count(w.ledger, ""))
			}
		})
	}
}

// byDo is Middleware.Do called by hand for a message (its Nats-Msg-Id, its
// body), and an ack after it returns.
func (w *world) byDo(b *testing.B, fn idemnats.Handler) func(msg jetstream.Msg) {
	source := "nats:" + w.stream + "/bench"
	return func(msg jetstream.Msg) {
		key := idem.Key{Source: source, EventID: msg.Headers().Get(jetstream.MsgIDHeader)}
		_, err := w.mw.Do(context.Background(), key, msg.Data(), func(ctx context.Context) ([]byte, error) {
			return nil, fn(ctx, msg)
		})
		if err == nil {
			err = msg.Ack()
		}
		if err != nil {
			b.Error(err)
		}
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

// byInline is the transactional inbox written by hand, on the world's
// adapter: BEGIN; the key's INSERT ... ON CONFLICT DO NOTHING (the same
// key, source and digest idemnats claims); when the key is new, the ledger
// row and the key's UPDATE storing the outcome; COMMIT; then the ack. A key
// already there is acked without a write.
func (w *world) byInline(b *testing.B) func(msg jetstream.Msg) {
	claim, complete := inlineSQL(w.table)
	write := `INSERT INTO ` + w.ledger + ` (event, body) VALUES ($1, $2)`
	source := "nats:" + w.stream + "/bench"
	return func(msg jetstream.Msg) {
		ctx := context.Background()
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		digest := sha256.Sum256(msg.Data())
		var one int
		var err error
		if w.pool != nil {
			var tx pgx.Tx
			if tx, err = w.pool.Begin(ctx); err == nil {
				if err = tx.QueryRow(ctx, claim, source, id, digest[:]).Scan(&one); err == nil {
					if _, err = tx.Exec(ctx, write, id, string(msg.Data())); err == nil {
						_, err = tx.Exec(ctx, complete, source, id, nil)
					}
				}
				if err == nil || errors.Is(err, pgx.ErrNoRows) {
					err = tx.Commit(ctx)
				}
				_ = tx.Rollback(ctx)
			}
		} else {
			var tx *sql.Tx
			if tx, err = db.BeginTx(ctx, nil); err == nil {
				if err = tx.QueryRowContext(ctx, claim, source, id, digest[:]).Scan(&one); err == nil {
					if _, err = tx.ExecContext(ctx, write, id, string(msg.Data())); err == nil {
						_, err = tx.ExecContext(ctx, complete, source, id, nil)
					}
				}
				if err == nil || errors.Is(err, sql.ErrNoRows) {
					err = tx.Commit()
				}
				_ = tx.Rollback()
			}
		}
		if err == nil {
			err = msg.Ack()
		}
		if err != nil {
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

// inlineSQL is the claim and the completion written by hand on table (the
// same statements as the root's benchmarks use; a module's tests import
// only what its users can): an INSERT of the key that does nothing for a
// key already there, and the UPDATE that stores the answer.
func inlineSQL(table string) (claim, complete string) {
	claim = `INSERT INTO ` + table + ` (source, event_id, payload_digest) VALUES ($1, $2, $3)
ON CONFLICT (source, event_id) DO NOTHING RETURNING 1`
	complete = `UPDATE ` + table + `
SET response_status = 200, response_headers = '{}', response_body = $3, completed_at = now()
WHERE source = $1 AND event_id = $2`
	return claim, complete
}
