// Package idemwatermill makes Watermill handlers exactly-once with idem: a
// message redelivered by the broker, or published twice, runs its handler
// once, and the handler's database writes commit with the key's claim and
// the messages it produced, in one PostgreSQL transaction.
//
//	mw, err := idem.New(db, idem.Options{Table: "inbox"}) // or idempgx.New(pool, ...)
//	...
//	poison, err := middleware.PoisonQueueWithFilter(pub, "poison", idemwatermill.IsPermanent)
//	exactlyOnce, err := idemwatermill.Middleware(mw)
//	router.AddMiddleware(poison, exactlyOnce) // the poison queue outside
//
// and in a handler:
//
//	tx, ok := idem.Tx(msg.Context()) // idempgx.Tx(msg.Context()) with idempgx
//
// The middleware is built on idem's Middleware.Do (docs/consumers.md). The
// key is the message's UUID (or a metadata entry, WithMetadataKey), scoped
// by the handler's name (WithSource's name, needed outside a router); the payload digest covers the payload only. The
// handler runs inside Do, with its transaction in msg.Context(); the
// messages it returns are stored with the claim and returned again, with
// their original UUIDs, metadata and payloads, when a later delivery of the
// key is replayed. So a crash between the COMMIT and the router's publish
// of those messages loses none: the redelivery publishes them.
//
// What the handler chain returns, and so what the router does:
//
//	outcome                                  returns                  router, broker
//	handler ran and committed                its messages, nil        publish, ack
//	replay (committed before)                stored messages, nil     publish, ack
//	payload mismatch, invalid key, payload   error, IsPermanent       PoisonQueue: publish to the
//	  too large, too old (WithRetention),                               poison topic, ack (without
//	  other errors idem.Retryable rejects,                              one: nack, redelivered)
//	  handler's error marked Permanent,
//	  panic in WithDigest's function, no
//	  source (no handler name, no WithSource)
//	another delivery holds the key           (held RetryAfter, then   as the second try's outcome
//	  (idem.ErrInFlight), other retryable     Do once more)
//	  errors of idem's (ErrUnavailable, ...)
//	still retryable after the second try     error                    nack: redelivered
//	handler's own error, panic               (held WithRetryDelay,    nack: redelivered
//	                                          1s) error
//
// Every error and every hold is logged (log/slog). See docs/watermill.md.
package idemwatermill

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// SourcePrefix is what Key.Source starts with, before the handler's name
// or WithSource's (and after the prefix of WithSourcePrefix):
// "watermill:<handler name>".
const SourcePrefix = "watermill:"

// PublishedAtKey is the metadata entry that WithRetention reads a message's
// publication time from (RFC 3339, as StampPublished writes it) unless
// WithTimestamp says otherwise.
const PublishedAtKey = "idem_published_at"

// ErrPermanent is what IsPermanent looks for: every error the middleware
// returns for a message that a redelivery would fail again wraps it (and,
// for idem's errors, the idem error too: errors.Is(err,
// idem.ErrPayloadMismatch) still holds).
var ErrPermanent = errors.New("idemwatermill: permanent failure, not worth a redelivery")

// ErrTooOld is returned, wrapped with ErrPermanent, for a message published
// longer ago than the retention (WithRetention): its key may have been
// swept from the table, so it is not run.
var ErrTooOld = errors.New("idemwatermill: message older than the retention")

// DefaultRetryDelay is how long the middleware holds a message whose
// handler failed or panicked before it returns the error (and the router
// nacks it), unless WithRetryDelay sets another delay.
const DefaultRetryDelay = time.Second

// ErrHandlerPanicked is returned, wrapped, for a delivery whose handler
// panicked: everything was rolled back, the panic and its stack were logged,
// and the delivery is nacked like one whose handler failed, so that one bad
// message cannot crash the consumer.
var ErrHandlerPanicked = errors.New("idemwatermill: handler panicked")

// permanentError marks an error as permanent for IsPermanent, keeping it in
// the chain for errors.Is and errors.As.
type permanentError struct{ err error }

func (e permanentError) Error() string        { return e.err.Error() }
func (e permanentError) Unwrap() error        { return e.err }
func (e permanentError) Is(target error) bool { return target == ErrPermanent }

// Permanent marks err, an error of the handler's own, as one a redelivery
// would meet again (a message that cannot be parsed, say): the handler's
// writes roll back as for any error, and IsPermanent reports true for what
// the middleware returns, so that a PoisonQueue built with IsPermanent takes
// the message. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// IsPermanent reports whether err, returned by the middleware, is one a
// redelivery would meet again: pass it to middleware.PoisonQueueWithFilter.
// It is true for idem's errors that idem.Retryable rejects (ErrInvalidKey,
// ErrBodyTooLarge, ErrPayloadMismatch, ErrResponseTooLarge, ...), for
// ErrTooOld and for the handler's errors marked with Permanent; false for
// nil, for the handler's other errors and for idem's retryable ones.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// Option configures Middleware.
type Option func(*config)

type config struct {
	prefix      string
	source      string
	metadataKey string
	digest      func(*message.Message) []byte
	retention   time.Duration
	timestamp   func(*message.Message) (time.Time, bool)
	logger      *slog.Logger
	retryDelay  time.Duration
	now         func() time.Time
}

// WithSourcePrefix puts prefix before Key.Source's "watermill:<handler
// name>", for handlers of the same name in services that share a table and
// must each process every message.
func WithSourcePrefix(prefix string) Option { return func(c *config) { c.prefix = prefix } }

// WithSource sets the name that scopes the keys, in place of the handler's
// name: Key.Source is then "watermill:<name>" (after WithSourcePrefix's
// prefix). Give it to handlers that compete for the messages of one queue
// (several handlers of one router on the same queue, for concurrency): they
// have different names but must share their keys, or a redelivery that
// reaches another of them would run again. Handlers that must each process
// every message (a fan-out) keep names of their own. A middleware whose
// messages carry no router handler name (called outside a router) needs
// it: without either name the message is refused, a permanent error.
func WithSource(name string) Option { return func(c *config) { c.source = name } }

// WithMetadataKey takes the key's EventID from the message's metadata entry
// name instead of its UUID: for publishers that give a redelivered event a
// new UUID but carry the event's own id in the metadata. A message without
// the entry is permanent (idem.ErrInvalidKey).
func WithMetadataKey(name string) Option { return func(c *config) { c.metadataKey = name } }

// WithDigest sets what stands for the message in the key's payload digest
// (and is bounded by Options.MaxBodyBytes): by default the payload. Use it
// for publishers that re-encode a message between sends (a canonical form
// of the payload) or to cover a metadata entry that is part of the message.
func WithDigest(f func(msg *message.Message) []byte) Option {
	return func(c *config) { c.digest = f }
}

// WithRetention sets how old a message may be and still run: an older one
// is permanent (ErrTooOld), logged, and its handler does not run, since its
// key may have been swept from the table. Set it to the retention the table
// is swept with; 0 means idemops.DefaultRetention, a negative value turns
// the check off. A message's age comes from WithTimestamp, by default its
// PublishedAtKey metadata entry; a message without one is never too old.
func WithRetention(d time.Duration) Option { return func(c *config) { c.retention = d } }

// WithTimestamp sets where a message's publication time comes from, for
// WithRetention: f returns it, or false when the message does not say. The
// default reads the PublishedAtKey metadata entry (see StampPublished).
func WithTimestamp(f func(msg *message.Message) (time.Time, bool)) Option {
	return func(c *config) { c.timestamp = f }
}

// WithLogger sets the logger of failed, held and permanent deliveries; nil
// (the default) means slog.Default().
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithRetryDelay sets how long a message whose handler returned an error
// (not marked Permanent) or panicked is held, unacked, before the
// middleware returns the error and the router nacks it: a nacked message
// is redelivered at once by most Pub/Subs (RabbitMQ's among them), so
// without a delay a failing handler would spend a delivery limit in
// milliseconds. 0 means DefaultRetryDelay (1s). A Retry middleware outside
// this one waits its own interval after each held attempt.
func WithRetryDelay(d time.Duration) Option { return func(c *config) { c.retryDelay = d } }

// Middleware returns a message.HandlerMiddleware that runs the handler it
// wraps once per key, inside mw.Do (see the package doc). Add it with
// Router.AddMiddleware or a handler's AddMiddleware, after (inside) the
// PoisonQueue middleware that should take its permanent errors, and after
// (inside) a Retry middleware if there is one, so that each attempt is a
// call of Do with a transaction of its own (give Retry a ShouldRetry that
// refuses IsPermanent errors). It fails for a nil mw or a nil Option.
func Middleware(mw *idem.Middleware, opts ...Option) (message.HandlerMiddleware, error) {
	if mw == nil {
		return nil, errors.New("idemwatermill: Middleware needs an *idem.Middleware")
	}
	c := &config{now: time.Now, timestamp: publishedAt}
	for _, o := range opts {
		if o == nil {
			return nil, errors.New("idemwatermill: nil Option")
		}
		o(c)
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
	switch {
	case c.timestamp == nil:
		return nil, errors.New("idemwatermill: WithTimestamp needs a function")
	case c.retryDelay < 0:
		return nil, errors.New("idemwatermill: WithRetryDelay's delay must not be negative")
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return c.handle(mw, h, msg)
		}
	}, nil
}

// StampPublished is a message.PublisherDecorator that sets PublishedAtKey
// on every message published without one, to the time of publication, for
// WithRetention. Decorate the publishers of the messages that the
// middleware's handlers consume (and the router's own, for the messages
// they produce).
func StampPublished(pub message.Publisher) (message.Publisher, error) {
	return message.MessageTransformPublisherDecorator(func(msg *message.Message) {
		if msg.Metadata.Get(PublishedAtKey) == "" {
			msg.Metadata.Set(PublishedAtKey, time.Now().UTC().Format(time.RFC3339Nano))
		}
	})(pub)
}

// publishedAt is the default timestamp: the PublishedAtKey entry.
func publishedAt(msg *message.Message) (time.Time, bool) {
	s := msg.Metadata.Get(PublishedAtKey)
	if s == "" {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	return t, err == nil
}

// key is the message's key: Source from the handler's name (or
// WithSource), EventID from the UUID or the metadata entry. Without either
// name the source would be "watermill:", shared by every such use of the
// table: that is refused, a permanent error.
func (c *config) key(msg *message.Message) (idem.Key, error) {
	id := msg.UUID
	if c.metadataKey != "" {
		id = msg.Metadata.Get(c.metadataKey)
	}
	name := c.source
	if name == "" {
		name = message.HandlerNameFromCtx(msg.Context())
	}
	if name == "" {
		return idem.Key{}, permanentError{errors.New("idemwatermill: no router handler name in the message's context and no WithSource: the keys would share the source \"" + c.prefix + SourcePrefix + "\" with every other such use; give the middleware WithSource")}
	}
	return idem.Key{Source: c.prefix + SourcePrefix + name, EventID: id}, nil
}

// handle is one delivery: the retention check, Do, and on a retryable
// error of idem's one hold and one more Do; on the handler's error a hold
// before returning it.
func (c *config) handle(mw *idem.Middleware, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	key, err := c.key(msg)
	if err != nil {
		c.logger.Error("idemwatermill: permanent: not run", "message_uuid", msg.UUID, "err", err)
		return nil, err
	}
	log := c.logger.With("message_uuid", msg.UUID, "source", key.Source, "event_id", key.EventID)
	if t, ok := c.timestamp(msg); ok && c.retention > 0 {
		if age := c.now().Sub(t); age > c.retention {
			err := permanentError{fmt.Errorf("%w: published %v ago, retention %v", ErrTooOld, age.Round(time.Second), c.retention)}
			log.Error("idemwatermill: permanent: not run", "err", err)
			return nil, err
		}
	}
	payload, err := c.payload(msg)
	if err != nil {
		log.Error("idemwatermill: permanent: for the poison queue", "err", err)
		return nil, err
	}
	out, res, err := c.do(mw, h, msg, key, payload)
	if err != nil && res.RetryAfter > 0 && idem.Retryable(err) {
		// Another delivery holds the key, or the database failed: hold
		// the message rather than spend a redelivery on it.
		log.Info("idemwatermill: holding the message: "+err.Error(), "hold", res.RetryAfter, "err", err)
		if c.hold(msg, res.RetryAfter) {
			out, res, err = c.do(mw, h, msg, key, payload)
		}
	}
	var herr *handlerError
	if errors.As(err, &herr) {
		err = herr.err
		if !IsPermanent(err) {
			// Most Pub/Subs redeliver a nacked message at once: hold it
			// first, or a failing handler spends the delivery limit in
			// milliseconds.
			log.Warn("idemwatermill: the handler failed; holding the message, then nacked for a redelivery", "hold", c.retryDelay, "err", err)
			c.hold(msg, c.retryDelay)
			return nil, err
		}
	}
	switch {
	case err == nil:
		if res.Replayed {
			log.Debug("idemwatermill: replayed", "messages", len(out))
		}
		return out, nil
	case IsPermanent(err):
		log.Error("idemwatermill: permanent: for the poison queue", "err", err)
		return nil, err
	case !idem.Retryable(err):
		err = permanentError{err}
		log.Error("idemwatermill: permanent: for the poison queue", "err", err)
		return nil, err
	default:
		log.Warn("idemwatermill: failed; nacked for a redelivery", "err", err)
		return nil, err
	}
}

// hold waits d, or until msg's context ends; it reports whether d passed.
func (c *config) hold(msg *message.Message, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-msg.Context().Done():
		return false
	}
}

// payload is what stands for msg in the digest: its payload, or what
// WithDigest's function returns, with a panic of that function turned into
// a permanent error (a redelivery would panic again).
func (c *config) payload(msg *message.Message) (b []byte, err error) {
	if c.digest == nil {
		return msg.Payload, nil
	}
	defer func() {
		if p := recover(); p != nil {
			c.logger.Error("idemwatermill: the WithDigest function panicked", "message_uuid", msg.UUID, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = permanentError{fmt.Errorf("idemwatermill: the WithDigest function panicked: %v", p)}
		}
	}()
	return c.digest(msg), nil
}

// handlerError marks the handler's own error (or its panic) in what do
// returns; handle takes it off.
type handlerError struct{ err error }

func (e *handlerError) Error() string { return e.err.Error() }
func (e *handlerError) Unwrap() error { return e.err }

// do calls Do once with h as its function, msg's context carrying the
// claim's transaction while h runs. It returns h's messages (or the stored
// ones, on a replay), and turns a panic in h into an error.
func (c *config) do(mw *idem.Middleware, h message.HandlerFunc, msg *message.Message, key idem.Key, payload []byte) (out []*message.Message, res idem.Result, err error) {
	orig := msg.Context()
	defer func() {
		msg.SetContext(orig)
		if p := recover(); p != nil {
			err = &handlerError{fmt.Errorf("%w: %v", ErrHandlerPanicked, p)}
			c.logger.Error("idemwatermill: handler panicked; rolled back", "message_uuid", msg.UUID, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		}
	}()
	ran := false
	res, err = mw.Do(orig, key, payload, func(ctx context.Context) ([]byte, error) {
		msg.SetContext(ctx)
		produced, err := h(msg)
		msg.SetContext(orig)
		if err != nil {
			return nil, &handlerError{err}
		}
		ran, out = true, produced
		return encode(produced)
	})
	if err != nil {
		return nil, res, err
	}
	if !ran || res.Replayed {
		out, err = decode(res.Value)
		if err != nil {
			return nil, res, permanentError{fmt.Errorf("idemwatermill: the key's stored answer is not a list of messages: %w", err)}
		}
	}
	return out, res, nil
}

// stored is a produced message as it is stored with the answer.
type stored struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// encode is the answer's Value: the produced messages, as a JSON list.
func encode(msgs []*message.Message) ([]byte, error) {
	list := make([]stored, len(msgs))
	for i, m := range msgs {
		list[i] = stored{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
	}
	return json.Marshal(list)
}

// decode is encode's inverse, for a replay; an empty Value is no messages.
func decode(value []byte) ([]*message.Message, error) {
	if len(value) == 0 {
		return nil, nil
	}
	var list []stored
	if err := json.Unmarshal(value, &list); err != nil {
		return nil, err
	}
	out := make([]*message.Message, 0, len(list))
	for _, s := range list {
		m := message.NewMessage(s.UUID, s.Payload)
		for k, v := range s.Metadata {
			m.Metadata.Set(k, v)
		}
		out = append(out, m)
	}
	return out, nil
}
