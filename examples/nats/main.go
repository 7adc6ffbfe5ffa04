// Command nats consumes orders from a NATS JetStream stream and records a
// shipment for each order exactly once, through idemnats: a redelivery, or
// the same order published again with the same Nats-Msg-Id, is acked
// without recording anything.
//
//	go run ./nats                                  # consumes ORDERS (orders.*) as "shipper"
//	go run ./nats -publish order-1 -body '{"sku":"A1"}'
//	go run ./nats -publish order-1 -body '{"sku":"A1"}'   # after 2 minutes: acked, not recorded again
//
// NATS with JetStream at -nats-url (default nats://127.0.0.1:4222) and
// PostgreSQL (DATABASE_URL) must be running.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
	"github.com/pgidem/idem/idemnats"
)

func main() {
	natsURL := flag.String("nats-url", nats.DefaultURL, "NATS server URL")
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	publish := flag.String("publish", "", "publish an order with this Nats-Msg-Id instead of consuming")
	body := flag.String("body", `{"sku":"A1"}`, "the order published with -publish")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *natsURL, *dsn, *publish, *body); err != nil {
		log.Fatal(example.OneLine(err))
	}
}

func run(ctx context.Context, natsURL, dsn, publish, body string) error {
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return fmt.Errorf("cannot reach NATS at %s: %w", natsURL, err)
	}
	defer nc.Drain() // the last acks reach the server before the connection closes
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if publish != "" {
		ack, err := js.Publish(ctx, "orders.new", []byte(body), jetstream.WithMsgID(publish))
		if err != nil {
			return err
		}
		log.Printf("published %s: stream sequence %d (duplicate within the stream's window: %v)", publish, ack.Sequence, ack.Duplicate)
		return nil
	}
	if dsn == "" {
		dsn = example.DatabaseURL()
	}
	db, err := example.OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	cons, err := setup(ctx, js, db, "ORDERS", "orders.*", 30*time.Second)
	if err != nil {
		return err
	}
	c, err := shipper(db, cons)
	if err != nil {
		return err
	}
	cc, err := cons.Consume(c.Handle)
	if err != nil {
		return err
	}
	log.Printf("consuming ORDERS as %q", "shipper")
	<-ctx.Done()
	cc.Drain() // finish the message in hand
	<-cc.Closed()
	return nil
}

// setup creates the tables, the stream (on subjects) and its durable
// consumer "shipper", if they do not exist. ackWait is how long JetStream
// waits for an ack before it redelivers (idemnats keeps a slower message
// with InProgress()).
func setup(ctx context.Context, js jetstream.JetStream, db *sql.DB, stream, subjects string, ackWait time.Duration) (jetstream.Consumer, error) {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS shipments (
		id       bigserial PRIMARY KEY,
		order_id text NOT NULL,
		items    text NOT NULL)`); err != nil {
		return nil, err
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subjects}}); err != nil {
		return nil, err
	}
	return js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:    "shipper", // durable: its name, and so the keys' source, is the same in every process
		AckWait:    ackWait,
		MaxDeliver: 10, // a message whose handler keeps failing stops after 10 deliveries
	})
}

// shipper records one shipment per order, in idem's transaction.
func shipper(db *sql.DB, cons jetstream.Consumer) (*idemnats.Consumer, error) {
	mw, err := idem.New(db, idem.Options{}) // Do only: no KeyFunc
	if err != nil {
		return nil, err
	}
	return idemnats.New(mw, cons, func(ctx context.Context, msg jetstream.Msg) error {
		tx, ok := idem.Tx(ctx)
		if !ok {
			return errors.New("not in idem's transaction")
		}
		key, _ := idem.KeyFromContext(ctx)
		// An error here rolls back; the message is redelivered later.
		_, err := tx.ExecContext(ctx, `INSERT INTO shipments (order_id, items) VALUES ($1, $2)`, key.EventID, string(msg.Data()))
		return err
	}, idemnats.WithLogger(slog.Default()))
}
