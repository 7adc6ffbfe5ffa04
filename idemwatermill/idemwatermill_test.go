package idemwatermill_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// world is one test's router, running the app's handler behind the poison
// queue and idem's middleware, on RabbitMQ, with its queues watched.
type world struct {
	t       *testing.T
	ns      names
	logs    *logs
	outs    *watcher
	poisons *watcher
}

func newWorld(t *testing.T, adapter string, opts idem.Options, wopts ...idemwatermill.Option) *world {
	t.Helper()
	w := &world{t: t, ns: newNames(t, false), logs: &logs{}}
	opts.Table, opts.Logger = w.ns.table, w.logs.logger()
	mw, err := newMiddleware(t.Context(), adapter, dbURL, opts, t.Cleanup)
	require.NoError(t, err)
	w.outs, w.poisons = watch(t, w.ns.out), watch(t, w.ns.poison)
	r, closers, err := newRouter(&app{db: db, ns: w.ns}, mw, false, 1, quiet,
		append([]idemwatermill.Option{idemwatermill.WithLogger(w.logs.logger()), idemwatermill.WithRetryDelay(50 * time.Millisecond)}, wopts...)...)
	require.NoError(t, err)
	ran := make(chan error, 1)
	go func() { ran <- r.Run(context.Background()) }()
	<-r.Running()
	t.Cleanup(func() {
		assert.NoError(t, r.Close())
		assert.NoError(t, <-ran)
		for _, c := range closers {
			assert.NoError(t, c())
		}
	})
	return w
}

// written is what the world's tables hold: keys, ledger rows, handler runs.
func (w *world) written() [3]int {
	return [3]int{count(w.t, w.ns.table, ""), count(w.t, w.ns.ledger, ""), count(w.t, w.ns.runs, "")}
}

// The outcomes over watermill's AMQP Pub/Sub, on a router with the poison
// queue (PoisonQueueWithFilter with IsPermanent) outside idem's middleware.
func TestOutcomesOverAMQP(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{MaxBodyBytes: 4096})
		in := w.ns.in

		t.Run("a new message runs, commits and publishes what the handler returned", func(t *testing.T) {
			publish(t, in, "order-1", "order 1")
			out := w.outs.next("output")
			assert.Equal(t, "done:order 1", out.body)
			assert.Equal(t, "order-1", out.headers["event"])
			assert.Equal(t, 1, count(t, w.ns.ledger, "event_id = 'order-1'"))
			assert.Equal(t, 1, count(t, w.ns.runs, "event_id = 'order-1' AND produced = $1", out.uuid))
		})
		t.Run("a duplicate is a replay: the same message, its UUID and metadata, published again", func(t *testing.T) {
			var first string
			require.NoError(t, db.QueryRow(`SELECT produced FROM `+w.ns.runs+` WHERE event_id = 'order-1'`).Scan(&first))
			publish(t, in, "order-1", "order 1")
			out := w.outs.next("output")
			assert.Equal(t, first, out.uuid)
			assert.Equal(t, "done:order 1", out.body)
			assert.Equal(t, "order-1", out.headers["event"])
			assert.Equal(t, 1, count(t, w.ns.runs, "event_id = 'order-1'"), "the handler did not run again")
			assert.Equal(t, 1, count(t, w.ns.ledger, "event_id = 'order-1'"))
		})
		t.Run("another payload under a used UUID goes to the poison queue", func(t *testing.T) {
			before := w.written()
			publish(t, in, "order-1", "order one")
			p := w.poisons.next("poison")
			assert.Equal(t, "order-1", p.uuid)
			assert.Equal(t, "order one", p.body)
			assert.Contains(t, p.headers[middleware.ReasonForPoisonedKey], "reused with a different")
			assert.Equal(t, "ledger", p.headers[middleware.PoisonedHandlerKey])
			assert.Equal(t, before, w.written())
			assert.True(t, w.logs.has("permanent", "event_id=order-1", "reused with a different"), w.logs.String())
		})
		for _, failed := range []struct{ name, uuid, body, logged string }{
			{"a handler error rolls back; the redelivery runs it again", "order-2", "fail-once", "nacked for a redelivery"},
			{"a panic is recovered, rolled back and nacked; the redelivery runs again", "order-3", "panic-once", "handler panicked"},
		} {
			t.Run(failed.name, func(t *testing.T) {
				publish(t, in, failed.uuid, failed.body)
				out := w.outs.next("output")
				assert.Equal(t, "done:"+failed.body, out.body)
				assert.Equal(t, 2, count(t, w.ns.runs, "event_id = $1", failed.uuid))
				assert.Equal(t, 1, count(t, w.ns.ledger, "event_id = $1", failed.uuid))
				assert.True(t, w.logs.has(failed.logged, failed.uuid), w.logs.String())
			})
		}
		t.Run("a handler error marked Permanent rolls back and goes to the poison queue", func(t *testing.T) {
			publish(t, in, "order-4", "permanent")
			p := w.poisons.next("poison")
			assert.Equal(t, "order-4", p.uuid)
			assert.Contains(t, p.headers[middleware.ReasonForPoisonedKey], "cannot parse the message")
			assert.Equal(t, 1, count(t, w.ns.runs, "event_id = 'order-4'"))
			assert.Zero(t, count(t, w.ns.ledger, "event_id = 'order-4'"))
			assert.Zero(t, count(t, w.ns.table, "event_id = 'order-4'"))
		})
		for _, bad := range []struct{ name, uuid, body, reason, logged string }{
			{"no UUID", "", "order", "invalid", `message_uuid="" `},
			{"a UUID over 255 bytes", strings.Repeat("u", 256), "order", "invalid", "message_uuid=" + strings.Repeat("u", 256) + " "},
			{"a payload over MaxBodyBytes", "order-big", strings.Repeat("x", 4097), "too large", "message_uuid=order-big "},
		} {
			t.Run(bad.name+" goes to the poison queue, logged, nothing written", func(t *testing.T) {
				before := w.written()
				publish(t, in, bad.uuid, bad.body)
				p := w.poisons.next("poison")
				assert.Equal(t, bad.uuid, p.uuid)
				assert.Contains(t, strings.ToLower(fmt.Sprint(p.headers[middleware.ReasonForPoisonedKey])), bad.reason)
				assert.Equal(t, before, w.written())
				assert.True(t, w.logs.has("permanent: for the poison queue", bad.logged, bad.reason), w.logs.String())
			})
		}
		t.Run("a message older than the retention goes to the poison queue, not run", func(t *testing.T) {
			before := w.written()
			old := time.Now().Add(-idemops.DefaultRetention - time.Hour).UTC().Format(time.RFC3339Nano)
			publish(t, in, "order-5", "order 5", idemwatermill.PublishedAtKey, old)
			p := w.poisons.next("poison")
			assert.Equal(t, "order-5", p.uuid)
			assert.Contains(t, p.headers[middleware.ReasonForPoisonedKey], "older than the retention")
			assert.Equal(t, before, w.written())
			assert.True(t, w.logs.has("not run", "order-5"), w.logs.String())
		})
		t.Run("a message within the retention runs", func(t *testing.T) {
			publish(t, in, "order-6", "order 6", idemwatermill.PublishedAtKey, time.Now().UTC().Format(time.RFC3339Nano))
			assert.Equal(t, "done:order 6", w.outs.next("output").body)
		})
		assert.Empty(t, w.outs.rest(), "no message published beyond those awaited")
		assert.Empty(t, w.poisons.rest(), "no message poisoned beyond those awaited")
	})
}
