package idemrabbitmq_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deliveryLimit is the x-delivery-limit of the tests' quorum queues: a
// message is delivered at most deliveryLimit+1 times, then dead-lettered.
const deliveryLimit = 2

// TestOutcomes: each outcome's broker answer, on a quorum queue with a
// delivery limit and a dead-letter queue, through one consumer, on each
// adapter: what is acked, what is requeued, what is rejected to the
// dead-letter exchange (and logged), and what is written.
func TestOutcomes(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, queueKind{quorum: true, limit: deliveryLimit})
		c := w.consume(adapter, idem.Options{MaxBodyBytes: 64}, idemrabbitmq.WithRetention(time.Hour), idemrabbitmq.WithRetryDelay(20*time.Millisecond))
		runsOf := func(id string) int { return count(t, w.runs, id) }

		// expectDead: the next action is a reject, the message is in the
		// dead-letter queue (reason rejected), a log line says why, and
		// nothing ran or was written.
		expectDead := func(t *testing.T, id, body string, logged ...string) {
			t.Helper()
			runsBefore := count(t, w.runs, "")
			ledgerBefore := count(t, w.ledger, "")
			assert.Equal(t, event{id, "reject"}, c.next(t))
			d, reason := w.dead()
			assert.Equal(t, id, d.MessageId)
			assert.Equal(t, body, string(d.Body))
			assert.Equal(t, "rejected", reason)
			assert.NotEmpty(t, c.logs.lines(append([]string{"level=ERROR", "rejected"}, logged...)...), "a log line with %q", logged)
			assert.Equal(t, runsBefore, count(t, w.runs, ""), "the handler did not run")
			assert.Equal(t, ledgerBefore, count(t, w.ledger, ""), "nothing written")
		}

		t.Run("a new message is processed, committed, then acked", func(t *testing.T) {
			w.publish(message{id: "m1", body: "hello"})
			assert.Equal(t, event{"m1", "ack"}, c.next(t))
			assert.Equal(t, 1, count(t, w.ledger, "m1"))
			assert.Equal(t, 1, runsOf("m1"))
		})
		t.Run("a duplicate is acked without running the handler", func(t *testing.T) {
			w.publish(message{id: "m1", body: "hello"})
			assert.Equal(t, event{"m1", "ack"}, c.next(t))
			assert.Equal(t, 1, count(t, w.ledger, "m1"))
			assert.Equal(t, 1, runsOf("m1"), "a replay")
		})
		t.Run("the same id with another body is rejected to the dead-letter exchange", func(t *testing.T) {
			w.publish(message{id: "m1", body: "other"})
			expectDead(t, "m1", "other", "message_id=m1", "used before with another body")
		})
		t.Run("a message without a MessageId is rejected", func(t *testing.T) {
			w.publish(message{body: "no id"})
			expectDead(t, "", "no id", "no MessageId")
		})
		t.Run("a MessageId idem refuses (a control character) is rejected", func(t *testing.T) {
			w.publish(message{id: "bad\x01id", body: "x"})
			expectDead(t, "bad\x01id", "x", "not a valid key")
		})
		t.Run("a MessageId over 255 bytes cannot be published at all", func(t *testing.T) {
			own, err := amqp.Dial(amqpURL) // the failed write closes the connection
			require.NoError(t, err)
			defer own.Close()
			ch, err := own.Channel()
			require.NoError(t, err)
			err = ch.PublishWithContext(t.Context(), "", w.queue, false, false,
				amqp.Publishing{MessageId: strings.Repeat("k", 256), Body: []byte("x")})
			assert.ErrorContains(t, err, "exceeds 255 bytes")
		})
		t.Run("a body over MaxBodyBytes is rejected", func(t *testing.T) {
			big := strings.Repeat("b", 65)
			w.publish(message{id: "big", body: big})
			expectDead(t, "big", big, "message_id=big", "larger than Options.MaxBodyBytes")
		})
		t.Run("a message older than the retention is rejected and does not run", func(t *testing.T) {
			w.publish(message{id: "old", body: "x", ts: time.Now().Add(-2 * time.Hour)})
			expectDead(t, "old", "x", "message_id=old", "older than the retention")
		})
		t.Run("a message within the retention runs", func(t *testing.T) {
			w.publish(message{id: "recent", body: "x", ts: time.Now().Add(-time.Minute)})
			assert.Equal(t, event{"recent", "ack"}, c.next(t))
			assert.Equal(t, 1, count(t, w.ledger, "recent"))
		})
		for _, body := range []string{"fail", "panic"} {
			t.Run("a handler that "+body+"s is requeued until the delivery limit dead-letters it, nothing written", func(t *testing.T) {
				w.publish(message{id: body, body: body})
				for range deliveryLimit + 1 {
					assert.Equal(t, event{body, "nack"}, c.next(t))
				}
				d, reason := w.dead()
				assert.Equal(t, body, d.MessageId)
				assert.Equal(t, "delivery_limit", reason)
				assert.Equal(t, deliveryLimit+1, runsOf(body), "one run per delivery")
				assert.Zero(t, count(t, w.ledger, body), "every run rolled back")
				assert.Len(t, c.logs.lines("level=WARN", "requeued", "message_id="+body), deliveryLimit+1)
			})
		}
		t.Run("after a panic the consumer goes on", func(t *testing.T) {
			assert.NotEmpty(t, c.logs.lines("level=ERROR", "handler panicked", "message_id=panic"))
			w.publish(message{id: "m2", body: "after"})
			assert.Equal(t, event{"m2", "ack"}, c.next(t))
			assert.Equal(t, 1, count(t, w.ledger, "m2"))
		})
		t.Run("nothing is left in the queues", func(t *testing.T) {
			assert.Zero(t, depth(t, w.queue))
			assert.Zero(t, depth(t, w.dlq))
		})
	})
}

// TestStartReport: Run's first log line says what it knows of the queue's
// dead-letter exchange and delivery limit, and warns when it knows of no
// dead-letter exchange.
func TestStartReport(t *testing.T) {
	w := newWorld(t, queueKind{quorum: true, limit: deliveryLimit})
	mw := w.middleware("database/sql", idem.Options{})
	for name, tc := range map[string]struct {
		opts []idemrabbitmq.Option
		want []string
	}{
		"queue arguments with a dead-letter exchange": {
			[]idemrabbitmq.Option{idemrabbitmq.WithQueueArgs(w.args)},
			[]string{"level=INFO", "consuming", "dead_letter_exchange=\"\"", "delivery_limit=2"}},
		"a dead-letter exchange set by a policy": {
			[]idemrabbitmq.Option{idemrabbitmq.WithDeadLetterExchange("dlx")},
			[]string{"level=INFO", "consuming", "dead_letter_exchange=dlx"}},
		"nothing known": {nil, []string{"level=WARN", "no dead-letter exchange"}},
	} {
		t.Run(name, func(t *testing.T) {
			logs := &syncBuffer{}
			c, err := idemrabbitmq.New(mw, w.queue, handlerFor(w.runs, w.ledger, db),
				append(tc.opts, idemrabbitmq.WithLogger(slogTo(logs)))...)
			require.NoError(t, err)
			deliveries := make(chan amqp.Delivery)
			close(deliveries)
			require.NoError(t, c.Run(t.Context(), deliveries))
			assert.Len(t, logs.lines(tc.want...), 1, logs.String())
		})
	}
}

// TestNew: what New refuses, and the key source it builds.
func TestNew(t *testing.T) {
	w := newWorld(t, queueKind{})
	mw := w.middleware("database/sql", idem.Options{})
	h := handlerFor(w.runs, w.ledger, db)
	c, err := idemrabbitmq.New(mw, "orders", h)
	require.NoError(t, err)
	assert.Equal(t, "rabbitmq:orders", c.Source())
	c, err = idemrabbitmq.New(mw, "orders", h, idemrabbitmq.WithSourcePrefix("eu/"))
	require.NoError(t, err)
	assert.Equal(t, "eu/rabbitmq:orders", c.Source())
	_, err = idemrabbitmq.New(mw, "orders", h, idemrabbitmq.WithLogger(nil))
	require.NoError(t, err, "a nil logger is slog.Default(), as in idemnats")

	for name, tc := range map[string]struct {
		mw    *idem.Middleware
		queue string
		h     idemrabbitmq.Handler
		opts  []idemrabbitmq.Option
	}{
		"no middleware":       {nil, "q", h, nil},
		"no handler":          {mw, "q", nil, nil},
		"no queue":            {mw, "", h, nil},
		"concurrency 0":       {mw, "q", h, []idemrabbitmq.Option{idemrabbitmq.WithConcurrency(0)}},
		"a source too long":   {mw, strings.Repeat("q", 250), h, nil},
		"a control character": {mw, "q\n", h, nil},
		"a negative delay":    {mw, "q", h, []idemrabbitmq.Option{idemrabbitmq.WithRetryDelay(-time.Second)}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := idemrabbitmq.New(tc.mw, tc.queue, tc.h, tc.opts...)
			assert.ErrorContains(t, err, "idemrabbitmq: ")
		})
	}
}

// TestDigest: WithDigest decides what a duplicate must match; by default
// the body, so a header that changes between sends does not matter.
func TestDigest(t *testing.T) {
	w := newWorld(t, queueKind{})
	c := w.consume("pgx", idem.Options{}, idemrabbitmq.WithDigest(func(d amqp.Delivery) []byte {
		return []byte(strings.ToLower(string(d.Body))) // a publisher that changes case
	}))
	w.publish(message{id: "d1", body: "Hello"}, message{id: "d1", body: "HELLO"})
	assert.Equal(t, event{"d1", "ack"}, c.next(t))
	assert.Equal(t, event{"d1", "ack"}, c.next(t))
	assert.Equal(t, 1, count(t, w.runs, "d1"), "the second is a replay")
}

// TestStopFinishesTheDeliveryInProgress: when Run's context ends, the
// delivery being handled is finished and acked, and Run returns.
func TestStopFinishesTheDeliveryInProgress(t *testing.T) {
	w := newWorld(t, queueKind{})
	mw := w.middleware("database/sql", idem.Options{})
	started, release := make(chan struct{}), make(chan struct{})
	inner := handlerFor(w.runs, w.ledger, db)
	c, err := idemrabbitmq.New(mw, w.queue, func(ctx context.Context, d amqp.Delivery) error {
		close(started)
		<-release
		return inner(ctx, d)
	}, idemrabbitmq.WithQueueArgs(w.args), idemrabbitmq.WithLogger(slogTo(&syncBuffer{})))
	require.NoError(t, err)
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	deliveries, err := ch.Consume(w.queue, "", false, false, false, false, nil)
	require.NoError(t, err)
	events := make(chan event, 10)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, recorded(deliveries, events)) }()
	w.publish(message{id: "s1", body: "x"})
	<-started
	cancel()
	close(release)
	assert.ErrorIs(t, <-done, context.Canceled)
	assert.Equal(t, event{"s1", "ack"}, <-events)
	assert.Equal(t, 1, count(t, w.ledger, "s1"))
}

// TestDatabaseErrorIsHeldThenRequeued: an error of idem's own that a
// retry may fix (here the table is gone: ErrUnavailable) is held for
// Options.RetryAfter and tried once more before the requeue, so each
// delivery spends one unit of the delivery limit for two tries; the
// handler never runs.
func TestDatabaseErrorIsHeldThenRequeued(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, queueKind{quorum: true, limit: deliveryLimit})
		c := w.consume(adapter, idem.Options{RetryAfter: 10 * time.Millisecond})
		_, err := db.Exec(`DROP TABLE ` + w.table)
		require.NoError(t, err)
		w.publish(message{id: "u1", body: "x"})
		for range deliveryLimit + 1 {
			assert.Equal(t, event{"u1", "nack"}, c.next(t))
		}
		d, reason := w.dead()
		assert.Equal(t, "u1", d.MessageId)
		assert.Equal(t, "delivery_limit", reason)
		assert.Len(t, c.logs.lines("level=DEBUG", "held", "message_id=u1"), deliveryLimit+1)
		assert.Len(t, c.logs.lines("level=WARN", "requeued", "message_id=u1"), deliveryLimit+1)
		assert.Zero(t, count(t, w.runs, "u1"))
	})
}

// TestAFailedHandlerIsHeldBeforeItsRequeue: RabbitMQ redelivers a
// requeued message at once, so a delivery whose handler failed is held,
// unacked, for WithRetryDelay before its Nack: a failing handler does not
// spend the delivery limit in a tight loop.
func TestAFailedHandlerIsHeldBeforeItsRequeue(t *testing.T) {
	t.Parallel()
	w := newWorld(t, queueKind{quorum: true, limit: deliveryLimit})
	delay := 300 * time.Millisecond
	c := w.consume("database/sql", idem.Options{}, idemrabbitmq.WithRetryDelay(delay))
	w.publish(message{id: "fail", body: "fail"})
	var last time.Time
	for range deliveryLimit + 1 {
		assert.Equal(t, event{"fail", "nack"}, c.next(t))
		now := time.Now()
		if !last.IsZero() {
			assert.GreaterOrEqual(t, now.Sub(last), delay, "held at least the delay between two nacks")
		}
		last = now
	}
	d, reason := w.dead()
	assert.Equal(t, "fail", d.MessageId)
	assert.Equal(t, "delivery_limit", reason)
	assert.Equal(t, deliveryLimit+1, count(t, w.runs, "fail"))
}

// TestAPanicInTheDigestIsRejected: a panic in WithDigest's function is
// recovered and logged, and the delivery rejected to the dead-letter
// exchange without running (a redelivery would panic again).
func TestAPanicInTheDigestIsRejected(t *testing.T) {
	t.Parallel()
	w := newWorld(t, queueKind{quorum: true, limit: deliveryLimit})
	c := w.consume("pgx", idem.Options{}, idemrabbitmq.WithDigest(func(amqp.Delivery) []byte { panic("cannot canonicalize") }))
	w.publish(message{id: "dp", body: "x"})
	assert.Equal(t, event{"dp", "reject"}, c.next(t))
	d, reason := w.dead()
	assert.Equal(t, "dp", d.MessageId)
	assert.Equal(t, "rejected", reason)
	assert.NotEmpty(t, c.logs.lines("level=ERROR", "WithDigest function panicked", "message_id=dp"))
	assert.Zero(t, count(t, w.runs, "dp"), "the handler did not run")
}

// TestRunTakesNoDeliveryAfterItsContextEnded: deliveries already in the
// channel's buffer when Run's context has ended are left alone (unacked,
// for RabbitMQ to requeue when the channel closes), however select picks.
func TestRunTakesNoDeliveryAfterItsContextEnded(t *testing.T) {
	w := newWorld(t, queueKind{})
	mw := w.middleware("database/sql", idem.Options{})
	c, err := idemrabbitmq.New(mw, w.queue, handlerFor(w.runs, w.ledger, db), idemrabbitmq.WithLogger(slogTo(&syncBuffer{})))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	events := make(chan event, 100)
	for range 20 { // select picks a ready case at random: try it often
		deliveries := make(chan amqp.Delivery, 1)
		deliveries <- amqp.Delivery{Acknowledger: recorder{noAck{}, "", events}, Body: []byte("x")}
		require.ErrorIs(t, c.Run(ctx, deliveries), context.Canceled)
	}
	assert.Empty(t, events, "no delivery was answered after the context ended")
}

// noAck is an Acknowledger that accepts everything.
type noAck struct{}

func (noAck) Ack(uint64, bool) error        { return nil }
func (noAck) Nack(uint64, bool, bool) error { return nil }
func (noAck) Reject(uint64, bool) error     { return nil }
