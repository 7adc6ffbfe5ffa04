package idemnats_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
)

// A durable consumer records one shipment per order, whatever the
// redeliveries. (db is a *sql.DB on PostgreSQL, js a jetstream.JetStream.)
func Example() {
	ctx := context.Background()
	_, _ = db.ExecContext(ctx, `DROP TABLE IF EXISTS example_keys`) // left by an earlier run
	if err := idem.Migrate(ctx, db, "example_keys"); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `DROP TABLE IF EXISTS example_shipments; CREATE TABLE example_shipments (order_id text NOT NULL, sku text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	const stream = "IDEMNATS_EXAMPLE"
	_ = js.DeleteStream(ctx, stream) // a stream left by an earlier run
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"example.orders"}}); err != nil {
		log.Fatal(err)
	}
	defer js.DeleteStream(ctx, stream) //nolint:errcheck // best effort

	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:    "shipper", // a durable name: the same in every process
		MaxDeliver: 10,        // bounds the redeliveries of a failing message
	})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idem.New(db, idem.Options{Table: "example_keys"})
	if err != nil {
		log.Fatal(err)
	}
	c, err := idemnats.New(mw, cons, func(ctx context.Context, msg jetstream.Msg) error {
		tx, _ := idem.Tx(ctx) // the claim's transaction
		key, _ := idem.KeyFromContext(ctx)
		_, err := tx.ExecContext(ctx, `INSERT INTO example_shipments VALUES ($1, $2)`, key.EventID, string(msg.Data()))
		return err // an error rolls back; the message is redelivered later
	})
	if err != nil {
		log.Fatal(err)
	}

	if _, err := js.Publish(ctx, "example.orders", []byte("A1"), jetstream.WithMsgID("order-1")); err != nil {
		log.Fatal(err)
	}
	// In a service: cons.Consume(c.Handle). Here, one message by hand.
	msg, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		log.Fatal(err)
	}
	key, _ := c.Key(msg)
	fmt.Println(key.Source, key.EventID)
	fmt.Println("acked:", c.HandleContext(ctx, msg) == nil)

	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM example_shipments`).Scan(&n)
	fmt.Println("shipments:", n)
	// Output:
	// nats:IDEMNATS_EXAMPLE/shipper order-1
	// acked: true
	// shipments: 1
}
