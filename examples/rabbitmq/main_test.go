package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
	amqp "github.com/rabbitmq/amqp091-go"
)

// TestRabbitMQ: an order published three times is shipped once and every
// delivery acked; the same MessageId with another body goes to the
// dead-letter queue. It needs RabbitMQ (RABBITMQ_URL, default the local
// one) and fails without it.
func TestRabbitMQ(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	url := os.Getenv("RABBITMQ_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp.Dial(url)
	require.NoError(t, err, "RabbitMQ is required")
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	t.Cleanup(func() { ch.Close() }) // after the queues are deleted
	var b [6]byte
	_, _ = rand.Read(b[:])
	queue := "idemrabbitmq_test_example_" + hex.EncodeToString(b[:])
	args, err := declare(ch, queue)
	require.NoError(t, err)
	t.Cleanup(func() {
		for _, q := range []string{queue, queue + ".dlq"} {
			_, err := ch.QueueDelete(q, false, false, false)
			assert.NoError(t, err)
		}
	})

	ctx := context.Background()
	c, err := setup(ctx, db, queue, args, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	publish := func(id, body string) {
		require.NoError(t, ch.PublishWithContext(ctx, "", queue, false, false,
			amqp.Publishing{MessageId: id, Body: []byte(body), DeliveryMode: amqp.Persistent}))
	}
	for range 3 {
		publish("order-1", "order-1")
	}
	publish("order-1", "another order")

	require.NoError(t, ch.Qos(8, 0, false))
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	require.NoError(t, err)
	four := make(chan amqp.Delivery) // Run returns after these four
	go func() {
		for range 4 {
			four <- <-deliveries
		}
		close(four)
	}()
	require.NoError(t, c.Run(ctx, four))

	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM shipments WHERE order_id = 'order-1'`))
	assert.Zero(t, webhooktest.Count(t, db, `SELECT count(*) FROM shipments WHERE order_id = 'another order'`))
	dead, err := ch.Consume(queue+".dlq", "", true, false, false, false, nil)
	require.NoError(t, err)
	select {
	case d := <-dead:
		assert.Equal(t, "another order", string(d.Body))
	case <-time.After(10 * time.Second):
		t.Fatal("the mismatched message did not reach the dead-letter queue")
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, args)
	require.NoError(t, err)
	assert.Zero(t, q.Messages, "every delivery settled")
}
