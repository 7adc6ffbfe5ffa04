package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestWatermill(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	url := os.Getenv("AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	p := fmt.Sprintf("idemwatermill_test_example_%d_%d", os.Getpid(), time.Now().UnixNano())
	tp := topics{orders: p + "_orders", shipments: p + "_shipments", poison: p + "_poison"}
	conn, err := amqp091.Dial(url)
	require.NoError(t, err, "RabbitMQ is required")
	t.Cleanup(func() {
		ch, err := conn.Channel()
		require.NoError(t, err)
		for _, q := range []string{tp.orders, tp.shipments, tp.poison} {
			_, err := ch.QueueDelete(q, false, false, false)
			assert.NoError(t, err)
		}
		conn.Close()
	})

	r, closeAll, err := setup(t.Context(), db, url, tp)
	require.NoError(t, err)
	ran := make(chan error, 1)
	go func() { ran <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		assert.NoError(t, r.Close())
		assert.NoError(t, <-ran)
		closeAll()
	})
	<-r.Running()

	sub, err := amqp.NewSubscriber(amqp.NewDurableQueueConfig(url), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { sub.Close() })
	shipped, err := sub.Subscribe(t.Context(), tp.shipments)
	require.NoError(t, err)
	poisoned, err := sub.Subscribe(t.Context(), tp.poison)
	require.NoError(t, err)
	next := func(ch <-chan *message.Message) *message.Message {
		t.Helper()
		select {
		case m := <-ch:
			m.Ack()
			return m
		case <-time.After(30 * time.Second):
			t.Fatal("no message within 30s")
			return nil
		}
	}
	shipments := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM shipments`) }

	t.Run("an order published twice ships once; the replay publishes the same event", func(t *testing.T) {
		require.NoError(t, publishOrder(url, tp, "order-1", order{Item: "book", Quantity: 2}))
		first := next(shipped)
		require.NoError(t, publishOrder(url, tp, "order-1", order{Item: "book", Quantity: 2}))
		again := next(shipped)
		assert.Equal(t, first.UUID, again.UUID)
		assert.Equal(t, string(first.Payload), string(again.Payload))
		var ev struct {
			Order    string `json:"order"`
			Shipment int64  `json:"shipment"`
		}
		require.NoError(t, json.Unmarshal(first.Payload, &ev))
		assert.Equal(t, "order-1", ev.Order)
		assert.Equal(t, 1, shipments())
	})
	t.Run("another order under a used UUID goes to the poison queue", func(t *testing.T) {
		require.NoError(t, publishOrder(url, tp, "order-1", order{Item: "pen", Quantity: 1}))
		m := next(poisoned)
		assert.Equal(t, "order-1", m.UUID)
		assert.Contains(t, m.Metadata.Get(middleware.ReasonForPoisonedKey), "different request body")
		assert.Equal(t, 1, shipments())
	})
	t.Run("an order the handler cannot read goes to the poison queue, nothing shipped", func(t *testing.T) {
		require.NoError(t, publishOrder(url, tp, "order-2", order{Item: "book"}))
		m := next(poisoned)
		assert.Equal(t, "order-2", m.UUID)
		assert.Contains(t, m.Metadata.Get(middleware.ReasonForPoisonedKey), "not an order")
		assert.Equal(t, 1, shipments())
	})
}
