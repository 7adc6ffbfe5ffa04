package idemwatermill_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
)

// A router whose handler ships each order once: the second delivery of
// order-1 is a replay, and the router publishes the "shipped" event the
// first delivery produced, with its UUID, again. (Any Pub/Sub will do; the
// example uses watermill's in-memory one.)
func ExampleMiddleware() {
	ctx := context.Background()
	if err := idem.Migrate(ctx, db, "example_inbox"); err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS example_shipments (order_id text NOT NULL)`); err != nil {
		panic(err)
	}
	mw, err := idem.New(db, idem.Options{Table: "example_inbox"}) // or idempgx.New(pool, ...)
	if err != nil {
		panic(err)
	}

	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	poison, err := middleware.PoisonQueueWithFilter(pubSub, "orders_poison", idemwatermill.IsPermanent)
	if err != nil {
		panic(err)
	}
	exactlyOnce, err := idemwatermill.Middleware(mw)
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(poison, exactlyOnce) // the poison queue outside
	router.AddHandler("ship", "orders", pubSub, "shipped", pubSub, func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := idem.Tx(msg.Context()) // idempgx.Tx with idempgx
		if !ok {
			return nil, fmt.Errorf("not in idem's transaction")
		}
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO example_shipments (order_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err // rolled back, nacked: the redelivery runs again
		}
		return []*message.Message{message.NewMessage("shipped-"+watermill.NewShortUUID(), []byte("shipped "+msg.UUID))}, nil
	})

	shipped, err := pubSub.Subscribe(ctx, "shipped")
	if err != nil {
		panic(err)
	}
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()

	var uuids []string
	for range 2 {
		if err := pubSub.Publish("orders", message.NewMessage("order-1", []byte(`{"item":"book"}`))); err != nil {
			panic(err)
		}
		m := <-shipped
		m.Ack()
		uuids = append(uuids, m.UUID)
		fmt.Println(string(m.Payload))
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM example_shipments`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("same event UUID:", uuids[0] == uuids[1])
	fmt.Println("shipments:", n)
	// Output:
	// shipped order-1
	// shipped order-1
	// same event UUID: true
	// shipments: 1
}

// Mark a handler error that a redelivery cannot fix with Permanent: the
// handler's writes roll back as for any error, and IsPermanent tells the
// poison queue to take the message instead of nacking it.
func ExamplePermanent() {
	handler := func(msg *message.Message) ([]*message.Message, error) {
		if len(msg.Payload) == 0 {
			return nil, idemwatermill.Permanent(fmt.Errorf("order %s is empty", msg.UUID))
		}
		return nil, nil
	}
	_, err := handler(message.NewMessage("order-1", nil))
	fmt.Println(idemwatermill.IsPermanent(err), err)
	// Output: true order order-1 is empty
}
