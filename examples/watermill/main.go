// Command watermill consumes orders from RabbitMQ with a Watermill router
// and ships each order exactly once, through idemwatermill: a redelivered or
// republished order (the same message UUID) does not ship again, and the
// "shipped" event that the handler returns is published again, with its
// first UUID, instead of a new one.
//
//	go run ./watermill                        # consumes the orders queue
//	go run ./watermill -publish order-1       # publishes order-1
//	go run ./watermill -publish order-1       # again: replayed, not shipped twice
//
// It reads DATABASE_URL and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/).
// Orders that can never be processed (a reused UUID with another body, a
// body that is not an order) go to the orders_poison queue.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/example"
	"github.com/pgidem/idem/idemwatermill"
)

// topics are the queues the example uses.
type topics struct {
	orders, shipments, poison string
}

var defaultTopics = topics{orders: "orders", shipments: "shipments", poison: "orders_poison"}

func main() {
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	amqpURL := flag.String("amqp-url", "", "RabbitMQ's URL (default: AMQP_URL, else amqp://guest:guest@127.0.0.1:5672/)")
	pub := flag.String("publish", "", "publish an order with this message UUID instead of consuming")
	flag.Parse()
	if *amqpURL == "" {
		*amqpURL = os.Getenv("AMQP_URL")
	}
	if *amqpURL == "" {
		*amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if *pub != "" {
		err = publishOrder(*amqpURL, defaultTopics, *pub, order{Item: "book", Quantity: 1})
	} else {
		err = consume(ctx, *dsn, *amqpURL)
	}
	if err != nil {
		log.Fatal(example.OneLine(err))
	}
}

// order is an orders message's payload.
type order struct {
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
}

// consume runs the router until ctx ends.
func consume(ctx context.Context, dsn, amqpURL string) error {
	if dsn == "" {
		dsn = example.DatabaseURL()
	}
	db, err := example.OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	r, closeAll, err := setup(ctx, db, amqpURL, defaultTopics)
	if err != nil {
		return err
	}
	defer closeAll()
	log.Printf("consuming %s", defaultTopics.orders)
	return r.Run(ctx)
}

// setup creates the tables and returns the router, not yet running, and a
// function that closes its publisher and subscriber.
func setup(ctx context.Context, db *sql.DB, amqpURL string, t topics) (*message.Router, func(), error) {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return nil, nil, err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS shipments (
		id       bigserial PRIMARY KEY,
		order_id text      NOT NULL,
		item     text      NOT NULL,
		quantity int       NOT NULL)`); err != nil {
		return nil, nil, err
	}
	mw, err := idem.New(db, idem.Options{}) // Do only: no KeyFunc
	if err != nil {
		return nil, nil, err
	}
	logger := watermill.NewSlogLogger(slog.Default())
	config := amqp.NewDurableQueueConfig(amqpURL)
	config.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(config, logger)
	if err != nil {
		return nil, nil, err
	}
	sub, err := amqp.NewSubscriber(config, logger)
	if err != nil {
		pub.Close()
		return nil, nil, err
	}
	closeAll := func() {
		sub.Close()
		pub.Close()
	}
	for _, q := range []string{t.orders, t.shipments, t.poison} {
		if err := sub.SubscribeInitialize(q); err != nil { // declares the queue
			closeAll()
			return nil, nil, err
		}
	}
	// The poison queue takes what idemwatermill marks permanent; every
	// other error is nacked, and RabbitMQ redelivers the order.
	poison, err := middleware.PoisonQueueWithFilter(pub, t.poison, idemwatermill.IsPermanent)
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	exactlyOnce, err := idemwatermill.Middleware(mw)
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	r.AddMiddleware(poison, exactlyOnce)
	r.AddHandler("ship", t.orders, sub, t.shipments, pub, ship)
	return r, closeAll, nil
}

// ship records the shipment in idem's transaction and returns the
// "shipped" event: both commit with the order's key, once.
func ship(msg *message.Message) ([]*message.Message, error) {
	var o order
	if err := json.Unmarshal(msg.Payload, &o); err != nil || o.Quantity <= 0 {
		return nil, idemwatermill.Permanent(fmt.Errorf("not an order: %s", msg.Payload))
	}
	ctx := msg.Context()
	tx, ok := idem.Tx(ctx)
	if !ok {
		return nil, errors.New("not in idem's transaction")
	}
	var id int64
	if err := tx.QueryRowContext(ctx, `INSERT INTO shipments (order_id, item, quantity) VALUES ($1, $2, $3) RETURNING id`,
		msg.UUID, o.Item, o.Quantity).Scan(&id); err != nil {
		return nil, err // rolled back: the redelivery runs again
	}
	shipped := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%q,"shipment":%d}`, msg.UUID, id))
	return []*message.Message{shipped}, nil
}

// publishOrder publishes o to the orders queue with uuid as its UUID.
func publishOrder(amqpURL string, t topics, uuid string, o order) error {
	config := amqp.NewDurableQueueConfig(amqpURL)
	config.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(config, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer pub.Close()
	body, err := json.Marshal(o)
	if err != nil {
		return err
	}
	return pub.Publish(t.orders, message.NewMessage(uuid, body))
}
