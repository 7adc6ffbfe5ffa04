// Command rabbitmq consumes an orders queue on RabbitMQ and records each
// order's shipment exactly once, through idemrabbitmq: a message published
// twice, or redelivered after a crash, is acked without a second shipment.
//
//	go run ./rabbitmq                          # consumes until Ctrl-C
//	go run ./rabbitmq -publish order-1         # publishes order 1 (MessageId order-1)
//	go run ./rabbitmq -publish order-1         # again: acked, not shipped twice
//
// It reads DATABASE_URL and RABBITMQ_URL (default
// amqp://guest:guest@127.0.0.1:5672/). The queue is a quorum queue with a
// delivery limit, whose rejected messages go to <queue>.dlq.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
)

func main() {
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	amqpURL := flag.String("amqp-url", "", "RabbitMQ URL (default $RABBITMQ_URL, else amqp://guest:guest@127.0.0.1:5672/)")
	queue := flag.String("queue", "orders", "the queue to consume")
	publish := flag.String("publish", "", "publish this order (its id is the MessageId) instead of consuming")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dsn, *amqpURL, *queue, *publish); err != nil {
		log.Fatal(example.OneLine(err))
	}
}

func run(ctx context.Context, dsn, amqpURL, queue, publish string) error {
	if amqpURL == "" {
		amqpURL = os.Getenv("RABBITMQ_URL")
	}
	if amqpURL == "" {
		amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	args, err := declare(ch, queue)
	if err != nil {
		return err
	}
	if publish != "" {
		return ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{
			MessageId: publish, Body: []byte(publish), DeliveryMode: amqp.Persistent})
	}

	if dsn == "" {
		dsn = example.DatabaseURL()
	}
	db, err := example.OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(10)
	c, err := setup(ctx, db, queue, args, slog.Default())
	if err != nil {
		return err
	}
	if err := ch.Qos(8, 0, false); err != nil { // prefetch: at least the concurrency
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil) // manual ack
	if err != nil {
		return err
	}
	log.Printf("consuming %s; publish with: go run ./rabbitmq -publish order-1", queue)
	if err := c.Run(ctx, deliveries); !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// declare declares queue, a quorum queue whose messages are delivered at
// most 6 times (x-delivery-limit 5) and whose rejected messages go, through
// the default exchange, to queue.dlq; it returns the queue's arguments.
func declare(ch *amqp.Channel, queue string) (amqp.Table, error) {
	args := amqp.Table{
		"x-queue-type":              "quorum",
		"x-delivery-limit":          5,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue + ".dlq",
	}
	if _, err := ch.QueueDeclare(queue+".dlq", true, false, false, false, nil); err != nil {
		return nil, err
	}
	_, err := ch.QueueDeclare(queue, true, false, false, false, args)
	return args, err
}

// setup creates the tables and builds the consumer: each order's shipment
// is written in the claim's transaction.
func setup(ctx context.Context, db *sql.DB, queue string, args amqp.Table, logger *slog.Logger) (*idemrabbitmq.Consumer, error) {
	if err := idem.Migrate(ctx, db, "inbox"); err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS shipments (
		id bigserial PRIMARY KEY, order_id text NOT NULL, message_id text NOT NULL)`); err != nil {
		return nil, err
	}
	mw, err := idem.New(db, idem.Options{Table: "inbox", Logger: logger}) // no KeyFunc: consumers only
	if err != nil {
		return nil, err
	}
	return idemrabbitmq.New(mw, queue, func(ctx context.Context, d amqp.Delivery) error {
		tx, ok := idem.Tx(ctx)
		if !ok {
			return errors.New("not inside idem")
		}
		var id int64
		err := tx.QueryRowContext(ctx, `INSERT INTO shipments (order_id, message_id) VALUES ($1, $2) RETURNING id`,
			string(d.Body), d.MessageId).Scan(&id)
		if err != nil {
			return err // rolled back; the message is requeued
		}
		logger.Info("shipped", "order", string(d.Body), "shipment", id)
		return nil
	}, idemrabbitmq.WithQueueArgs(args), idemrabbitmq.WithConcurrency(4), idemrabbitmq.WithLogger(logger))
}
