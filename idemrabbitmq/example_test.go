package idemrabbitmq_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
)

// A consumer of a quorum queue whose rejected messages go to a
// dead-letter queue: a message published twice is processed once, and
// both deliveries are acked.
func Example() {
	ctx := context.Background()
	queue := fmt.Sprintf("idemrabbitmq_test_example_%d", os.Getpid())
	if err := idem.Migrate(ctx, db, "inbox"); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE shipments (order_id text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	defer db.Exec(`DROP TABLE shipments, inbox`)

	// The queue: a delivery limit bounds the requeues of a failing
	// message, and a dead-letter exchange (here the default one, routing
	// to queue_dlq) keeps what is rejected.
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	defer ch.Close()
	args := amqp.Table{
		"x-queue-type":              "quorum",
		"x-delivery-limit":          5,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue + "_dlq",
	}
	for name, a := range map[string]amqp.Table{queue + "_dlq": nil, queue: args} {
		if _, err := ch.QueueDeclare(name, true, false, false, false, a); err != nil {
			log.Fatal(err)
		}
		defer ch.QueueDelete(name, false, false, false)
	}

	mw, err := idem.New(db, idem.Options{Table: "inbox"}) // or idempgx.New(pool, ...)
	if err != nil {
		log.Fatal(err)
	}
	c, err := idemrabbitmq.New(mw, queue, func(ctx context.Context, d amqp.Delivery) error {
		tx, _ := idem.Tx(ctx) // the claim's transaction
		_, err := tx.ExecContext(ctx, `INSERT INTO shipments (order_id) VALUES ($1)`, string(d.Body))
		return err // an error rolls back and requeues
	},
		idemrabbitmq.WithQueueArgs(args),
		idemrabbitmq.WithConcurrency(2),
		idemrabbitmq.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		log.Fatal(err)
	}

	// The publisher sends order 42 twice, with the same MessageId.
	for range 2 {
		err := ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{
			MessageId: "order-42", Body: []byte("42"), DeliveryMode: amqp.Persistent})
		if err != nil {
			log.Fatal(err)
		}
	}

	if err := ch.Qos(4, 0, false); err != nil { // prefetch at least the concurrency
		log.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil) // manual ack
	if err != nil {
		log.Fatal(err)
	}
	// Here Run gets the two deliveries and returns; a service passes it
	// the channel itself and runs until its context ends.
	two := make(chan amqp.Delivery)
	go func() {
		for range 2 {
			two <- <-deliveries
		}
		close(two)
	}()
	if err := c.Run(ctx, two); err != nil {
		log.Fatal(err)
	}

	var n int
	if err := db.QueryRow(`SELECT count(*) FROM shipments`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("shipments:", n)
	// Output: shipments: 1
}
