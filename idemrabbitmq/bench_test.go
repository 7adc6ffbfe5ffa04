package idemrabbitmq_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// BenchmarkConsumer: b.N messages, published beforehand, consumed from a
// queue and each written as one ledger row, then acked: by the idem
// consumer (idem: the claim, the row and the answer in one transaction,
// ack after COMMIT) and by a hand-written ack-after-commit consumer doing
// the same write in a transaction of its own (byhand), on each adapter,
// 1 and 4 deliveries at once (prefetch twice that). The variants run
// interleaved, IDEMRABBITMQ_BENCH_ROUNDS times (1 by default):
//
//	IDEMRABBITMQ_BENCH_ROUNDS=5 go test -run '^$' -bench Consumer -benchtime 1000x ./idemrabbitmq
//
// docs/performance.md has the figures.
func BenchmarkConsumer(b *testing.B) {
	rounds := 1
	if s := os.Getenv("IDEMRABBITMQ_BENCH_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	for range rounds {
		for _, concurrency := range []int{1, 4} {
			for _, adapter := range adapters {
				for _, variant := range []string{"byhand", "idem"} {
					name := fmt.Sprintf("%s/%s/concurrency=%d", pgxOrSQL(adapter), variant, concurrency)
					b.Run(name, func(b *testing.B) { benchConsume(b, adapter, variant == "idem", concurrency) })
				}
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

func benchConsume(b *testing.B, adapter string, useIdem bool, concurrency int) {
	w := newWorld(b, queueKind{})
	msgs := make([]message, b.N)
	for i := range msgs {
		msgs[i] = message{id: fmt.Sprintf("b%d", i), body: fmt.Sprintf(`{"order":%d}`, i)}
	}
	w.publish(msgs...)

	var run func(ctx context.Context, deliveries <-chan amqp.Delivery)
	if useIdem {
		mw := w.middleware(adapter, idem.Options{})
		c, err := idemrabbitmq.New(mw, w.queue, func(ctx context.Context, d amqp.Delivery) error {
			return writeLedger(ctx, w.ledger, d)
		}, idemrabbitmq.WithConcurrency(concurrency), idemrabbitmq.WithQueueArgs(w.args),
			idemrabbitmq.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
		require.NoError(b, err)
		run = func(ctx context.Context, deliveries <-chan amqp.Delivery) { _ = c.Run(ctx, deliveries) }
	} else {
		write := byHandWriter(b, adapter, w.ledger)
		run = func(ctx context.Context, deliveries <-chan amqp.Delivery) {
			var wg sync.WaitGroup
			for range concurrency {
				wg.Go(func() {
					for {
						select {
						case <-ctx.Done():
							return
						case d, ok := <-deliveries:
							if !ok {
								return
							}
							if err := write(ctx, d); err != nil {
								_ = d.Nack(false, true)
								continue
							}
							_ = d.Ack(false)
						}
					}
				})
			}
			wg.Wait()
		}
	}

	ch, err := conn.Channel()
	require.NoError(b, err)
	defer ch.Close()
	require.NoError(b, ch.Qos(2*concurrency, 0, false))
	done := make(chan struct{})
	acks := &counter{target: int64(b.N), done: done}
	b.ReportAllocs()
	b.ResetTimer()
	deliveries, err := ch.Consume(w.queue, "", false, false, false, false, nil)
	require.NoError(b, err)
	counted := make(chan amqp.Delivery)
	go func() {
		defer close(counted)
		for d := range deliveries {
			d.Acknowledger = countingAck{d.Acknowledger, acks}
			counted <- d
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	finished := make(chan struct{})
	go func() { run(ctx, counted); close(finished) }()
	<-done
	b.StopTimer()
	cancel()
	<-finished
	require.Equal(b, b.N, count(b, w.ledger, ""))
}

// counter counts acks and closes done at the target.
type counter struct {
	n      atomic.Int64
	target int64
	done   chan struct{}
}

// countingAck is an Acknowledger that counts acks.
type countingAck struct {
	amqp.Acknowledger
	c *counter
}

func (a countingAck) Ack(tag uint64, multiple bool) error {
	err := a.Acknowledger.Ack(tag, multiple)
	if a.c.n.Add(1) == a.c.target {
		close(a.c.done)
	}
	return err
}

// byHandWriter is the hand-written consumer's write: the ledger row in a
// transaction of its own, on adapter's driver.
func byHandWriter(b *testing.B, adapter, ledger string) func(ctx context.Context, d amqp.Delivery) error {
	q := `INSERT INTO ` + ledger + ` (msg, body) VALUES ($1, $2)`
	if adapter == "pgx" {
		pool, err := pgxpool.New(context.Background(), dbURL)
		require.NoError(b, err)
		b.Cleanup(pool.Close)
		return func(ctx context.Context, d amqp.Delivery) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, q, d.MessageId, string(d.Body)); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	d0, err := sql.Open("pgx", dbURL)
	require.NoError(b, err)
	d0.SetMaxOpenConns(10)
	b.Cleanup(func() { d0.Close() })
	return func(ctx context.Context, d amqp.Delivery) error {
		tx, err := d0.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, q, d.MessageId, string(d.Body)); err != nil {
			return err
		}
		return tx.Commit()
	}
}
