package idemwatermill_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
)

// BenchmarkHandler: a message with a new UUID through a handler that
// appends one ledger row and returns one message, called as the router
// calls it (no broker: what is measured is the handler chain). idem is
// idemwatermill around the handler (the claim, the row and the encoded
// message commit together); do is the same handler called through
// Middleware.Do by hand, without idemwatermill (its own cost: the context,
// the encoding of the messages); byhand writes the row in a transaction of
// its own, as an ack-after-commit consumer without idem does. Compare
// idem with do and byhand as ratios of one run (-count 6, benchstat).
func BenchmarkHandler(b *testing.B) {
	for _, adapter := range adapters {
		ns := benchNames(b)
		mw, err := newMiddleware(b.Context(), adapter, dbURL, idem.Options{Table: ns.table, Logger: (&logs{}).logger()}, b.Cleanup)
		if err != nil {
			b.Fatal(err)
		}
		var pool *pgxpool.Pool
		if adapter == "pgx" {
			if pool, err = pgxpool.New(b.Context(), dbURL); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(pool.Close)
		}
		a := &app{db: db, ns: ns}
		write := func(msg *message.Message) ([]*message.Message, error) {
			if err := a.write(msg.Context(), msg.UUID, string(msg.Payload)); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, msg.Payload)}, nil
		}
		m, err := idemwatermill.Middleware(mw, idemwatermill.WithLogger((&logs{}).logger()), idemwatermill.WithSource("bench"))
		if err != nil {
			b.Fatal(err)
		}
		handlers := map[string]message.HandlerFunc{
			"idem": m(write),
			"do": func(msg *message.Message) ([]*message.Message, error) {
				orig := msg.Context()
				var out []*message.Message
				_, err := mw.Do(orig, idem.Key{Source: "bench", EventID: msg.UUID}, msg.Payload, func(ctx context.Context) ([]byte, error) {
					msg.SetContext(ctx)
					defer msg.SetContext(orig)
					var err error
					out, err = write(msg)
					return nil, err
				})
				return out, err
			},
			"byhand": byHand(ns.ledger, pool),
		}
		var n int
		for _, name := range []string{"idem", "do", "byhand"} {
			b.Run(fmt.Sprintf("%s/%s", adapterName(adapter), name), func(b *testing.B) {
				h := handlers[name]
				b.ReportAllocs()
				for b.Loop() {
					n++
					if _, err := h(message.NewMessage(fmt.Sprintf("%s-%d", name, n), []byte(`{"order":"book"}`))); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// byHand is an ack-after-commit handler without idem: the row in a
// transaction of its own, on the adapter's pool.
func byHand(ledger string, pool *pgxpool.Pool) message.HandlerFunc {
	q := `INSERT INTO ` + ledger + ` (event_id, body) VALUES ($1, $2)`
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if pool != nil {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
			if _, err := tx.Exec(ctx, q, msg.UUID, string(msg.Payload)); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, msg.Payload)}, tx.Commit(ctx)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback() //nolint:errcheck // after Commit, a no-op
		if _, err := tx.ExecContext(ctx, q, msg.UUID, string(msg.Payload)); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("out-"+msg.UUID, msg.Payload)}, tx.Commit()
	}
}

func adapterName(adapter string) string {
	if adapter == "pgx" {
		return "pgx"
	}
	return "sql"
}

// benchNames creates a benchmark's key table and ledger.
func benchNames(b *testing.B) names {
	n := seq.Add(1)
	ns := names{table: fmt.Sprintf("bench_keys_%d", n), ledger: fmt.Sprintf("bench_ledger_%d", n)}
	if err := idem.Migrate(b.Context(), db, ns.table); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE ` + ns.ledger + ` (event_id text NOT NULL, body text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	return ns
}
