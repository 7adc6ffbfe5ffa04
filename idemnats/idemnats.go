package idemnats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// DefaultRetryDelay is how long NakWithDelay asks JetStream to wait before
// it redelivers a message whose handler failed, unless WithRetryDelay sets
// another delay.
const DefaultRetryDelay = time.Second

// SourcePrefix is what Key.Source starts with, after WithSourcePrefix's
// prefix: the source is "nats:<stream>/<durable consumer name>".
const SourcePrefix = "nats:"

// ErrConsumer is the error New returns for a consumer idem cannot serve: an
// ephemeral one (no durable name), or one whose ack policy is not
// AckExplicit.
var ErrConsumer = errors.New("idemnats: unusable consumer")

// ErrTooOld is wrapped by the error HandleContext returns for a message
// stored in its stream longer ago than the retention (WithRetention): it
// was terminated without running, since its key may have been swept.
var ErrTooOld = errors.New("idemnats: message older than the retention")

// Handler is the user's function: it runs at most once to completion per
// message key. Its writes go through idem.Tx(ctx) (idempgx.Tx(ctx) on a
// pgx pool), the claim's transaction, and commit with the key. Returning
// an error rolls them back; the message is redelivered later.
type Handler func(ctx context.Context, msg jetstream.Msg) error

// ConsumerInfo is what New reads of a consumer: jetstream.Consumer (pull)
// and jetstream.PushConsumer both have it.
type ConsumerInfo interface {
	CachedInfo() *jetstream.ConsumerInfo
}

// Option configures New.
type Option func(*config)

type config struct {
	prefix     string
	digest     func(jetstream.Msg) []byte
	retention  time.Duration
	logger     *slog.Logger
	retryDelay time.Duration
	heartbeat  time.Duration
	lease      time.Duration
}

// WithSourcePrefix puts prefix before the derived source of every key
// ("eu/" makes it "eu/nats:ORDERS/shipper"; see New): for streams of the
// same name on two NATS systems sharing one table. An empty prefix (the
// default) adds nothing.
func WithSourcePrefix(prefix string) Option {
	return func(c *config) { c.prefix = prefix }
}

// WithDigest sets what stands for a message's payload, for publishers that
// re-encode the same message (a redelivery with other bytes would
// otherwise be refused as a payload mismatch): f returns the bytes whose
// SHA-256 is stored with the key, e.g. a canonical encoding of the
// message's fields. The default is the message body, msg.Data(); headers
// are left out, since they may change from one publication to the next.
// What f returns is bounded by idem.Options.MaxBodyBytes as a body is.
func WithDigest(f func(msg jetstream.Msg) []byte) Option {
	return func(c *config) { c.digest = f }
}

// WithRetention sets the age past which a message is terminated without
// running: a message stored in its stream longer ago than d (by the
// stream's own timestamp) may have had its key swept from the table, so
// running it again could repeat its effect. Set it to the table's sweep
// retention (idemops.SweepOptions.Retention). 0 means
// idemops.DefaultRetention (30 days); a negative d turns the check off.
func WithRetention(d time.Duration) Option {
	return func(c *config) { c.retention = d }
}

// WithLogger sets the logger of the consumer's decisions (a terminated
// message, a handler's error, a failed ack). nil means slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger = l }
}

// WithRetryDelay sets the delay of NakWithDelay after the handler returned
// an error or panicked. 0 means DefaultRetryDelay.
func WithRetryDelay(d time.Duration) Option {
	return func(c *config) { c.retryDelay = d }
}

// WithHeartbeat sets how often a message being handled (or held for an
// original in flight) is kept with InProgress(), and, in lease mode, its
// lease extended with idem.ExtendLease. 0 means half the consumer's
// AckWait, or a third of WithLease's lease if that is shorter. In lease
// mode keep it well under idem.Options.Lease (a third of it).
func WithHeartbeat(d time.Duration) Option {
	return func(c *config) { c.heartbeat = d }
}

// WithLease tells the consumer the middleware's idem.Options.Lease (give
// the same value), for the default heartbeat: a third of the lease when
// that is shorter than half the consumer's AckWait, so that the lease is
// extended before it runs out. Without it, a Lease under about half the
// AckWait runs out before the first beat. 0 (the default) means the
// middleware is not in lease mode, or its lease is long enough.
func WithLease(lease time.Duration) Option {
	return func(c *config) { c.lease = lease }
}

// Consumer runs a Handler exactly once per message key, on a middleware's
// table. Its Handle method is what consumer.Consume takes.
type Consumer struct {
	mw     *idem.Middleware
	fn     Handler
	stream string
	source string
	epoch  string // the consumer's creation time: this incarnation of it and its stream

	heartbeat time.Duration
	config
}

// New wraps fn for the messages of cons, a durable JetStream consumer with
// AckExplicit (the default ack policy); any other consumer is refused with
// an error wrapping ErrConsumer. An ephemeral consumer's name changes from
// one process to the next, so a redelivery to another process would be
// keyed under another source and run again.
//
// Each message's key is: Source "nats:<stream>/<durable name>" (after
// WithSourcePrefix's prefix, if set); EventID the message's
// Nats-Msg-Id header (the publisher's id, which JetStream also dedups
// within the stream's duplicate window) when present and not empty,
// otherwise "<stream>:<consumer created>:<stream sequence>" (the
// consumer's creation time in Unix nanoseconds, from its info), which stays
// the same across redeliveries of one stored message and changes when the
// stream (and so the consumer) is deleted and created again: its sequence
// restarts at 1, and a new message must not be taken for an old one. A
// durable consumer deleted and created again on the same stream also
// starts new keys: messages without Nats-Msg-Id it delivers again then run
// again. The payload whose digest is stored
// is the body (WithDigest sets another).
//
// Use it as
//
//	c, err := idemnats.New(mw, cons, handle)
//	...
//	cc, err := cons.Consume(c.Handle)
//
// or call HandleContext for each message of cons.Messages() or
// cons.Fetch. A consumer whose MaxDeliver is unlimited is logged at New:
// a message whose handler always fails is then redelivered forever.
func New(mw *idem.Middleware, cons ConsumerInfo, fn Handler, opts ...Option) (*Consumer, error) {
	if mw == nil || cons == nil || fn == nil {
		return nil, errors.New("idemnats: New needs a middleware, a consumer and a handler")
	}
	c := &Consumer{mw: mw, fn: fn}
	for _, o := range opts {
		o(&c.config)
	}
	info := cons.CachedInfo()
	switch {
	case info == nil:
		return nil, fmt.Errorf("%w: no consumer info", ErrConsumer)
	case info.Config.Durable == "":
		return nil, fmt.Errorf("%w: consumer %q on stream %q is ephemeral: its name changes from one process to the next, so a redelivery to another process would run again; create it with a Durable name", ErrConsumer, info.Name, info.Stream)
	case info.Config.AckPolicy != jetstream.AckExplicitPolicy:
		return nil, fmt.Errorf("%w: consumer %q has ack policy %s; idem acks each message after its commit and needs AckExplicit", ErrConsumer, info.Name, info.Config.AckPolicy)
	case c.retryDelay < 0 || c.heartbeat < 0 || c.lease < 0:
		return nil, errors.New("idemnats: durations must not be negative")
	}
	c.stream = info.Stream
	c.epoch = strconv.FormatInt(info.Created.UnixNano(), 10)
	c.source = c.prefix + SourcePrefix + info.Stream + "/" + info.Config.Durable
	if err := validSource(c.source); err != nil {
		return nil, err
	}
	if c.digest == nil {
		c.digest = jetstream.Msg.Data
	}
	if c.retention == 0 {
		c.retention = idemops.DefaultRetention
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	if c.retryDelay == 0 {
		c.retryDelay = DefaultRetryDelay
	}
	c.heartbeat = c.config.heartbeat
	if c.heartbeat == 0 {
		c.heartbeat = info.Config.AckWait / 2
		if c.heartbeat <= 0 {
			c.heartbeat = 15 * time.Second // the server's default AckWait is 30s
		}
		if c.lease > 0 {
			c.heartbeat = min(c.heartbeat, c.lease/3)
		}
	}
	if info.Config.MaxDeliver < 1 {
		c.logger.Warn("idemnats: the consumer's MaxDeliver is unlimited: a message whose handler always fails is redelivered forever; set MaxDeliver to bound it",
			"stream", info.Stream, "consumer", info.Name)
	}
	return c, nil
}

// validSource checks what idem checks of a key's source (1 to 255 bytes of
// UTF-8 without control characters), so that a bad prefix fails New rather
// than terminate every message.
func validSource(s string) error {
	if len(s) > 255 || !utf8.ValidString(s) || strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return fmt.Errorf("idemnats: the source %q is not 1 to 255 bytes of UTF-8 without control characters: shorten or fix WithSourcePrefix", s)
	}
	return nil
}

// Source is the Key.Source of this consumer's messages.
func (c *Consumer) Source() string { return c.source }

// Key returns the idempotency key of msg, as New describes it, with the
// message's metadata (it fails for a message that is not JetStream's).
func (c *Consumer) Key(msg jetstream.Msg) (idem.Key, error) {
	meta, err := msg.Metadata()
	if err != nil {
		return idem.Key{}, err
	}
	return c.key(msg, meta), nil
}

func (c *Consumer) key(msg jetstream.Msg, meta *jetstream.MsgMetadata) idem.Key {
	if id := msg.Headers().Get(jetstream.MsgIDHeader); id != "" {
		return idem.Key{Source: c.source, EventID: id}
	}
	return idem.Key{Source: c.source, EventID: meta.Stream + ":" + c.epoch + ":" + strconv.FormatUint(meta.Sequence.Stream, 10)}
}

// Handle handles one delivery of a message, as HandleContext does with
// context.Background(); it is a jetstream.MessageHandler, for Consume.
func (c *Consumer) Handle(msg jetstream.Msg) {
	_ = c.HandleContext(context.Background(), msg)
}

// HandleContext runs the handler for msg through idem.Middleware.Do and
// answers JetStream after the outcome is final:
//
//   - committed now, or replayed (an earlier delivery committed): Ack;
//   - the handler returned an error or panicked (rolled back): logged,
//     NakWithDelay(WithRetryDelay's delay);
//   - idem.ErrInFlight (another delivery of the key runs): the message is
//     held, kept with InProgress(), for Result.RetryAfter, and Do is
//     called once more, so that waiting for a live original does not
//     spend the consumer's MaxDeliver; still in flight, or another error
//     idem.Retryable reports true for: logged, NakWithDelay(RetryAfter);
//   - a key or payload idem refuses (idem.ErrInvalidKey, e.g. a
//     Nats-Msg-Id over 255 bytes; idem.ErrBodyTooLarge;
//     idem.ErrPayloadMismatch, the id reused for another body), a panic
//     of WithDigest's function, or any other error a redelivery would
//     meet again: logged, Term;
//   - stored in the stream longer ago than the retention: logged, Term,
//     never run (ErrTooOld).
//
// While the handler runs, and while the message is held, it is kept with
// InProgress() at every heartbeat (WithHeartbeat), and in lease mode the
// key's lease is extended on the same beat. HandleContext returns nil when
// it acked msg, else the error that decided the answer (already logged).
// ctx bounds the call as it bounds Do.
func (c *Consumer) HandleContext(ctx context.Context, msg jetstream.Msg) error {
	meta, err := msg.Metadata()
	if err != nil {
		c.logger.ErrorContext(ctx, "idemnats: not a JetStream message; left unanswered", "subject", msg.Subject(), "err", err)
		return err
	}
	if age := time.Since(meta.Timestamp); c.retention > 0 && age > c.retention {
		err := fmt.Errorf("%w: stored %v ago, retention %v", ErrTooOld, age.Round(time.Second), c.retention)
		c.term(ctx, msg, meta, idem.Key{}, err)
		return err
	}
	key := c.key(msg, meta)
	payload, err := c.payload(msg)
	if err != nil {
		c.term(ctx, msg, meta, key, err)
		return err
	}
	hb := c.beat(msg)
	defer hb.stop()
	fn := func(ctx context.Context) ([]byte, error) {
		hb.enter(ctx)
		defer hb.leave()
		return nil, c.call(ctx, msg)
	}
	res, err := c.mw.Do(ctx, key, payload, fn)
	if errors.Is(err, idem.ErrInFlight) {
		c.logger.DebugContext(ctx, "idemnats: another delivery of the key is in flight; holding the message", c.attrs(meta, key, "hold", res.RetryAfter)...)
		t := time.NewTimer(res.RetryAfter)
		select {
		case <-t.C:
			res, err = c.mw.Do(ctx, key, payload, fn)
		case <-ctx.Done():
			t.Stop()
		}
	}
	hb.stop()

	var herr *handlerError
	switch {
	case err == nil:
		if ackErr := msg.Ack(); ackErr != nil {
			c.logger.WarnContext(ctx, "idemnats: ack failed after commit; the message will be redelivered and replayed", c.attrs(meta, key, "err", ackErr)...)
			return ackErr
		}
		if c.logger.Enabled(ctx, slog.LevelDebug) { // the common path: no attributes built for nothing
			c.logger.DebugContext(ctx, "idemnats: acked", c.attrs(meta, key, "replayed", res.Replayed)...)
		}
		return nil
	case errors.As(err, &herr):
		c.nak(ctx, msg, meta, key, c.retryDelay, err)
	case idem.Retryable(err):
		c.nak(ctx, msg, meta, key, res.RetryAfter, err)
	default:
		c.term(ctx, msg, meta, key, err)
	}
	return err
}

// payload is what stands for msg's payload (WithDigest's function), with a
// panic of that function turned into an error: a redelivery would panic
// again, so the message is terminated rather than crash the consumer.
func (c *Consumer) payload(msg jetstream.Msg) (b []byte, err error) {
	defer func() {
		if p := recover(); p != nil {
			c.logger.Error("idemnats: the WithDigest function panicked", "panic", p, "stack", string(debug.Stack()))
			err = fmt.Errorf("idemnats: the WithDigest function panicked: %v", p)
		}
	}()
	return c.digest(msg), nil
}

// call runs the handler, and turns a panic into its error, so that one
// message cannot crash-loop the consumer.
func (c *Consumer) call(ctx context.Context, msg jetstream.Msg) (err error) {
	defer func() {
		if p := recover(); p != nil {
			c.logger.ErrorContext(ctx, "idemnats: the handler panicked; rolled back, to be redelivered", "panic", p, "stack", string(debug.Stack()))
			err = &handlerError{fmt.Errorf("idemnats: the handler panicked: %v", p)}
		}
	}()
	if err := c.fn(ctx, msg); err != nil {
		return &handlerError{err}
	}
	return nil
}

// handlerError marks the handler's own error in what Do returns.
type handlerError struct{ err error }

func (e *handlerError) Error() string { return e.err.Error() }
func (e *handlerError) Unwrap() error { return e.err }

func (c *Consumer) nak(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, key idem.Key, delay time.Duration, err error) {
	if nakErr := msg.NakWithDelay(delay); nakErr != nil {
		c.logger.WarnContext(ctx, "idemnats: nak failed; the message is redelivered after AckWait", c.attrs(meta, key, "err", err, "nak_err", nakErr)...)
		return
	}
	c.logger.WarnContext(ctx, "idemnats: not processed; redelivery asked for later", c.attrs(meta, key, "delay", delay, "err", err)...)
}

// term terminates msg: JetStream will not redeliver it. Term, not
// TermWithReason: servers before 2.10.4 ignore the latter, and the reason
// is in the log.
func (c *Consumer) term(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, key idem.Key, err error) {
	if termErr := msg.Term(); termErr != nil {
		c.logger.ErrorContext(ctx, "idemnats: term failed; the message is redelivered after AckWait", c.attrs(meta, key, "err", err, "term_err", termErr)...)
		return
	}
	c.logger.ErrorContext(ctx, "idemnats: terminated: a redelivery would fail the same way", c.attrs(meta, key, "err", err)...)
}

func (c *Consumer) attrs(meta *jetstream.MsgMetadata, key idem.Key, more ...any) []any {
	a := []any{"stream", meta.Stream, "consumer", meta.Consumer, "seq", meta.Sequence.Stream, "delivered", meta.NumDelivered}
	if key.EventID != "" {
		a = append(a, "source", key.Source, "event_id", key.EventID)
	}
	return append(a, more...)
}
