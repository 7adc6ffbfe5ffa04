package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestNATS(t *testing.T) {
	t.Parallel()
	url := os.Getenv("NATS_URL")
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url)
	require.NoError(t, err, "NATS with JetStream is required (set NATS_URL)")
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	db := testdb.Open(t)
	ctx := t.Context()

	stream := fmt.Sprintf("EXAMPLE_ORDERS_%d", os.Getpid())
	subject := strings.ToLower(stream) + ".new"
	cons, err := setup(ctx, js, db, stream, subject, time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	c, err := shipper(db, cons)
	require.NoError(t, err)

	// order-1 is published twice: the second, a retry by the publisher
	// within the stream's duplicate window (2 minutes), JetStream drops
	// itself; idem covers what the window does not (a redelivery after
	// a crash, a publication after the window), keyed the same way.
	for _, id := range []string{"order-1", "order-1", "order-2"} {
		_, err := js.Publish(ctx, subject, []byte(`{"sku":"A1"}`), jetstream.WithMsgID(id))
		require.NoError(t, err)
	}
	// order-1's ack is lost (as in a crash between the COMMIT and the
	// ack): JetStream redelivers it after AckWait; the redelivery is acked
	// and records nothing.
	msg, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	require.NoError(t, err)
	require.NoError(t, c.HandleContext(ctx, lostAck{msg}))
	for range 2 { // order-2, and order-1 again
		msg, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
		require.NoError(t, err)
		require.NoError(t, c.HandleContext(ctx, msg))
	}
	assert.Equal(t, 2, webhooktest.Count(t, db, `SELECT count(*) FROM shipments`))
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM shipments WHERE order_id = 'order-1'`))
}

// lostAck is a delivered message whose ack never reaches the server.
type lostAck struct{ jetstream.Msg }

func (lostAck) Ack() error { return nil }
