// Package idemrabbitmq makes a RabbitMQ consumer's database writes happen
// once per message with idem: each delivery's handler runs inside the
// claim of the message's id, its writes commit with the claim, and the
// delivery is acked only after that COMMIT. A redelivery of a message whose
// writes committed (the consumer crashed before its ack, or the publisher
// sent it twice) is acked without running the handler again.
//
//	mw, err := idem.New(db, idem.Options{}) // or idempgx.New(pool, ...); no KeyFunc needed
//	...
//	c, err := idemrabbitmq.New(mw, "orders", handle,
//		idemrabbitmq.WithQueueArgs(args), // the arguments the queue was declared with
//		idemrabbitmq.WithConcurrency(4))
//	...
//	deliveries, err := ch.Consume("orders", "", false, false, false, false, nil) // manual ack
//	...
//	err = c.Run(ctx, deliveries)
//
// and in the handler, func(ctx context.Context, d amqp.Delivery) error:
//
//	tx, ok := idem.Tx(ctx) // idempgx.Tx(ctx) with idempgx
//
// The key is the message's MessageId property, scoped by the queue's name
// (Key.Source is "rabbitmq:" and the queue's name, after an optional
// prefix); the payload whose digest is stored with it is the message body.
// What each outcome does to the delivery:
//
//	handler returned nil, or a replay           Ack
//	no MessageId, or one idem refuses          Reject(requeue=false): to the queue's dead-letter exchange
//	body over Options.MaxBodyBytes             Reject(requeue=false)
//	same MessageId, another body               Reject(requeue=false)
//	Timestamp older than the retention         Reject(requeue=false), and the handler does not run
//	other errors a redelivery cannot fix       Reject(requeue=false)
//	another delivery holds the key (in flight) held, not acked, for idem's Result.RetryAfter, then tried once more
//	handler error, or panic (recovered)        held, not acked, for WithRetryDelay (1s), then Nack(requeue=true)
//	other retryable errors                     held for Result.RetryAfter, tried once more, then Nack(requeue=true)
//	WithDigest's function panicked (recovered) Reject(requeue=false), and the handler does not run
//
// Every Reject and Nack is logged. RabbitMQ redelivers a requeued message
// at once (hence the holds before a requeue) and, on a classic queue,
// without limit: bound the redeliveries
// with a quorum queue's x-delivery-limit and give the queue a dead-letter
// exchange (docs/rabbitmq.md).
package idemrabbitmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Handler processes one delivery. Its writes go through the claim's
// transaction, idem.Tx(ctx) (or idempgx.Tx(ctx)), and commit with the
// claim; an error rolls them back and the delivery is requeued. It must
// not ack, nack or reject d: the consumer does, after the COMMIT.
type Handler func(ctx context.Context, d amqp.Delivery) error

// SourcePrefix is what Key.Source starts with, before the queue's name
// (and after the prefix of WithSourcePrefix).
const SourcePrefix = "rabbitmq:"

// DefaultRetryDelay is how long a delivery whose handler failed or
// panicked is held, unacked, before it is requeued, unless WithRetryDelay
// sets another delay.
const DefaultRetryDelay = time.Second

// ErrHandlerPanicked is the error a delivery whose handler panicked is
// logged with (the panic's value and stack go with it); the delivery is
// then treated as one whose handler failed: rolled back and requeued.
var ErrHandlerPanicked = errors.New("idemrabbitmq: handler panicked")

// Consumer runs a Handler exactly once per message of one queue. Build it
// with New; it is safe for one Run at a time.
type Consumer struct {
	mw          *idem.Middleware
	handler     Handler
	queue       string
	source      string
	concurrency int
	digest      func(amqp.Delivery) []byte
	retention   time.Duration
	retryDelay  time.Duration
	logger      *slog.Logger
	dlx         string // the queue's dead-letter exchange, as the options tell it
	dlxKnown    bool
	limit       any // the queue's x-delivery-limit, as the options tell it; nil if unknown
}

// Option configures a Consumer.
type Option func(*Consumer)

// WithConcurrency sets how many deliveries are processed at once (1 by
// default). Set the channel's prefetch (Channel.Qos) to at least n, or the
// extra workers wait for deliveries.
func WithConcurrency(n int) Option { return func(c *Consumer) { c.concurrency = n } }

// WithSourcePrefix puts prefix before Key.Source's "rabbitmq:<queue>", for
// queues of the same name that are not the same queue (two virtual hosts,
// two brokers) and share a table, or two consumers of the same messages
// (a fan-out) that must each process every one.
func WithSourcePrefix(prefix string) Option { return func(c *Consumer) { c.source = prefix } }

// WithDigest sets what stands for the message in the key's payload digest
// (and is bounded by Options.MaxBodyBytes): by default the body. Use it
// for publishers that re-encode a message between sends (a canonical form
// of the body) or to cover a header that is part of the message.
func WithDigest(f func(d amqp.Delivery) []byte) Option {
	return func(c *Consumer) { c.digest = f }
}

// WithRetention sets how old a delivery may be (by its Timestamp property)
// and still run: an older one is rejected to the dead-letter exchange,
// logged, and its handler does not run, since its key may have been swept
// from the table. Set it to the retention the table is swept with; 0 means
// idemops.DefaultRetention, a negative value turns the check off. A
// delivery without a Timestamp is never judged too old.
func WithRetention(d time.Duration) Option { return func(c *Consumer) { c.retention = d } }

// WithRetryDelay sets how long a delivery whose handler returned an error
// or panicked is held, unacked, before Nack(requeue=true): RabbitMQ
// redelivers a requeued message at once, so without a delay a failing
// handler would spend a delivery limit in milliseconds. 0 means
// DefaultRetryDelay (1s).
func WithRetryDelay(d time.Duration) Option { return func(c *Consumer) { c.retryDelay = d } }

// WithLogger sets the logger of rejected and requeued deliveries and of
// the start report; nil (the default) means slog.Default().
func WithLogger(l *slog.Logger) Option { return func(c *Consumer) { c.logger = l } }

// WithQueueArgs tells the consumer the arguments the queue was declared
// with (the amqp.Table given to QueueDeclare): their x-dead-letter-exchange
// and x-delivery-limit are reported at the start of Run, and a queue
// without a dead-letter exchange is warned about. AMQP 0-9-1 gives a
// client no way to read a queue's arguments or policy.
func WithQueueArgs(args amqp.Table) Option {
	return func(c *Consumer) {
		if x, ok := args["x-dead-letter-exchange"].(string); ok {
			c.dlx, c.dlxKnown = x, true
		}
		if l, ok := args["x-delivery-limit"]; ok {
			c.limit = l
		}
	}
}

// WithDeadLetterExchange tells the consumer that the queue dead-letters
// to exchange, for a queue whose dead-letter exchange a policy sets
// (rabbitmqctl set_policy ... '{"dead-letter-exchange":"..."}') rather
// than its arguments. "" is RabbitMQ's default exchange.
func WithDeadLetterExchange(exchange string) Option {
	return func(c *Consumer) { c.dlx, c.dlxKnown = exchange, true }
}

// New wraps h into a consumer of queue's deliveries on mw. It fails when
// mw or h is nil, queue is empty, the concurrency is below 1, or the key
// source ("rabbitmq:<queue>" after the prefix) is not a valid key part
// (over idem.MaxKeyLen bytes, not UTF-8, control characters).
func New(mw *idem.Middleware, queue string, h Handler, opts ...Option) (*Consumer, error) {
	c := &Consumer{mw: mw, handler: h, queue: queue, concurrency: 1, logger: slog.Default()}
	for _, o := range opts {
		o(c)
	}
	c.source += SourcePrefix + queue
	switch {
	case mw == nil:
		return nil, errors.New("idemrabbitmq: New needs a middleware")
	case h == nil:
		return nil, errors.New("idemrabbitmq: New needs a handler")
	case queue == "":
		return nil, errors.New("idemrabbitmq: New needs the queue's name (it scopes the keys)")
	case c.concurrency < 1:
		return nil, fmt.Errorf("idemrabbitmq: concurrency %d is below 1", c.concurrency)
	case c.retryDelay < 0:
		return nil, errors.New("idemrabbitmq: WithRetryDelay's delay must not be negative")
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	if c.retryDelay == 0 {
		c.retryDelay = DefaultRetryDelay
	}
	if len(c.source) > idem.MaxKeyLen || !utf8.ValidString(c.source) || strings.ContainsFunc(c.source, unicode.IsControl) {
		return nil, fmt.Errorf("idemrabbitmq: the key source %q is over %d bytes, not UTF-8 or has control characters", c.source, idem.MaxKeyLen)
	}
	if c.retention == 0 {
		c.retention = idemops.DefaultRetention
	}
	return c, nil
}

// Source is Key.Source of this consumer's keys: the prefix, if any, then
// "rabbitmq:" and the queue's name.
func (c *Consumer) Source() string { return c.source }

// Run processes deliveries, which must come from Channel.Consume with
// autoAck false, until the channel is closed (it returns nil) or ctx ends
// (it returns ctx's error). At its start it logs the queue's dead-letter
// exchange and delivery limit as the options told them, and warns when no
// dead-letter exchange is known: a rejected message is then dropped.
//
// When ctx ends, Run takes no more deliveries; those being processed are
// finished (each bounded by Options.HandlerTimeout) and acked or requeued,
// except one held (for a key in flight, or after a handler's error), which
// is requeued at once. Run
// returns when they are done. Deliveries still in the channel's buffer
// stay unacked: close the channel (or its connection) after Run returns,
// and RabbitMQ requeues them.
func (c *Consumer) Run(ctx context.Context, deliveries <-chan amqp.Delivery) error {
	c.report()
	var wg sync.WaitGroup
	for range c.concurrency {
		wg.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case d, ok := <-deliveries:
					if !ok {
						return
					}
					if ctx.Err() != nil { // select picks at random among ready cases
						return
					}
					c.handle(ctx, d)
				}
			}
		})
	}
	wg.Wait()
	return ctx.Err()
}

// report logs what the consumer knows of its queue.
func (c *Consumer) report() {
	attrs := []any{"queue", c.queue, "source", c.source, "concurrency", c.concurrency, "retention", c.retention}
	if c.limit != nil {
		attrs = append(attrs, "delivery_limit", c.limit)
	}
	if !c.dlxKnown {
		c.logger.Warn("idemrabbitmq: no dead-letter exchange is known for the queue: rejected messages (no MessageId, payload mismatch, too old, too large) will be dropped; declare the queue with x-dead-letter-exchange (or a policy) and say so with WithQueueArgs or WithDeadLetterExchange", attrs...)
		return
	}
	c.logger.Info("idemrabbitmq: consuming", append(attrs, "dead_letter_exchange", c.dlx)...)
}

// handle runs one delivery and acks, nacks or rejects it. ctx is Run's:
// it ends a hold, not a handler that runs.
func (c *Consumer) handle(ctx context.Context, d amqp.Delivery) {
	if d.MessageId == "" {
		c.reject(d, "rejected: the message has no MessageId, the key of its deliveries", idem.ErrInvalidKey)
		return
	}
	if c.retention > 0 && !d.Timestamp.IsZero() {
		if age := time.Since(d.Timestamp); age > c.retention {
			c.reject(d, "rejected: the message is older than the retention: its key may have been swept, so it does not run",
				fmt.Errorf("idemrabbitmq: timestamp %s is %s old, over the retention %s", d.Timestamp.UTC().Format(time.RFC3339), age.Round(time.Second), c.retention))
			return
		}
	}
	key := idem.Key{Source: c.source, EventID: d.MessageId}
	payload, err := c.payload(d)
	if err != nil {
		c.reject(d, "rejected: the WithDigest function panicked", err)
		return
	}
	work := context.WithoutCancel(ctx) // a handler that runs is finished, bounded by HandlerTimeout
	res, err := c.do(work, key, payload, d)
	if err != nil && res.RetryAfter > 0 && idem.Retryable(err) {
		// Another delivery holds the key (or the database failed): hold
		// this one, unacked, rather than spend a redelivery on it.
		c.logger.Debug("idemrabbitmq: held: "+err.Error(), "queue", c.queue, "message_id", d.MessageId, "retry_after", res.RetryAfter)
		t := time.NewTimer(res.RetryAfter)
		select {
		case <-t.C:
			res, err = c.do(work, key, payload, d)
		case <-ctx.Done():
			t.Stop()
		}
	}
	switch {
	case err == nil:
		if aerr := d.Ack(false); aerr != nil {
			c.logger.Warn("idemrabbitmq: ack failed; the message will come again and be replayed", "queue", c.queue, "message_id", d.MessageId, "replayed", res.Replayed, "err", aerr)
		}
	case errors.Is(err, ErrHandlerPanicked) || errors.As(err, new(*handlerError)):
		// RabbitMQ redelivers a requeued message at once: hold it first,
		// or a failing handler spends the delivery limit in milliseconds.
		t := time.NewTimer(c.retryDelay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		c.requeue(d, err)
	case idem.Retryable(err):
		c.requeue(d, err)
	default:
		c.reject(d, rejection(err), err)
	}
}

// requeue nacks d with requeue, and logs it.
func (c *Consumer) requeue(d amqp.Delivery, err error) {
	c.logger.Warn("idemrabbitmq: requeued: "+err.Error(), "queue", c.queue, "message_id", d.MessageId, "redelivered", d.Redelivered, "err", err)
	if nerr := d.Nack(false, true); nerr != nil {
		c.logger.Warn("idemrabbitmq: nack failed", "queue", c.queue, "message_id", d.MessageId, "err", nerr)
	}
}

// rejection says why a delivery that failed with err is rejected.
func rejection(err error) string {
	switch {
	case errors.Is(err, idem.ErrPayloadMismatch):
		return "rejected: the MessageId was used before with another body"
	case errors.Is(err, idem.ErrInvalidKey):
		return "rejected: the MessageId is not a valid key (over 255 bytes, not UTF-8, or control characters)"
	case errors.Is(err, idem.ErrBodyTooLarge):
		return "rejected: the body is larger than Options.MaxBodyBytes"
	}
	return "rejected: a redelivery would fail the same way"
}

// reject rejects d without requeue, to the queue's dead-letter exchange,
// and logs it.
func (c *Consumer) reject(d amqp.Delivery, msg string, err error) {
	dlx := "(none known: dropped)"
	if c.dlxKnown {
		dlx = c.dlx
	}
	c.logger.Error("idemrabbitmq: "+msg, "queue", c.queue, "message_id", d.MessageId, "dead_letter_exchange", dlx, "err", err)
	if rerr := d.Reject(false); rerr != nil {
		c.logger.Warn("idemrabbitmq: reject failed", "queue", c.queue, "message_id", d.MessageId, "err", rerr)
	}
}

// do calls Do with the handler, and turns a panic of the handler (which
// Do rolled back) into an error.
func (c *Consumer) do(ctx context.Context, key idem.Key, payload []byte, d amqp.Delivery) (res idem.Result, err error) {
	defer func() {
		if p := recover(); p != nil {
			res, err = idem.Result{}, fmt.Errorf("%w: %v", ErrHandlerPanicked, p)
			c.logger.Error("idemrabbitmq: handler panicked; rolled back", "queue", c.queue, "message_id", d.MessageId, "panic", p, "stack", string(debug.Stack()))
		}
	}()
	return c.mw.Do(ctx, key, payload, func(ctx context.Context) ([]byte, error) {
		if err := c.handler(ctx, d); err != nil {
			return nil, &handlerError{err}
		}
		return nil, nil
	})
}

// handlerError marks the handler's own error in what Do returns.
type handlerError struct{ err error }

func (e *handlerError) Error() string { return e.err.Error() }
func (e *handlerError) Unwrap() error { return e.err }

// payload is what stands for d in the key's digest: the body, or what
// WithDigest's function returns, with a panic of that function turned into
// an error (a redelivery would panic again).
func (c *Consumer) payload(d amqp.Delivery) (b []byte, err error) {
	if c.digest == nil {
		return d.Body, nil
	}
	defer func() {
		if p := recover(); p != nil {
			c.logger.Error("idemrabbitmq: the WithDigest function panicked", "queue", c.queue, "message_id", d.MessageId, "panic", p, "stack", string(debug.Stack()))
			err = fmt.Errorf("idemrabbitmq: the WithDigest function panicked: %v", p)
		}
	}()
	return c.digest(d), nil
}
