package idemwatermill_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// direct is the middleware around the app's handler, called directly (no
// router, no broker: no handler name, so the source is WithSource's,
// "direct").
type direct struct {
	ns   names
	logs *logs
	h    message.HandlerFunc
}

func newDirect(t *testing.T, adapter string, opts idem.Options, wopts ...idemwatermill.Option) *direct {
	t.Helper()
	d := &direct{ns: newNames(t, false), logs: &logs{}}
	opts.Table, opts.Logger = d.ns.table, d.logs.logger()
	mw, err := newMiddleware(t.Context(), adapter, dbURL, opts, t.Cleanup)
	require.NoError(t, err)
	m, err := idemwatermill.Middleware(mw, append([]idemwatermill.Option{idemwatermill.WithLogger(d.logs.logger()), idemwatermill.WithSource("direct")}, wopts...)...)
	require.NoError(t, err)
	d.h = m((&app{db: db, ns: d.ns}).handle)
	return d
}

func msg(uuid, payload string, metadata ...string) *message.Message {
	m := message.NewMessage(uuid, []byte(payload))
	for i := 0; i+1 < len(metadata); i += 2 {
		m.Metadata.Set(metadata[i], metadata[i+1])
	}
	return m
}

func TestReplayReturnsTheStoredMessages(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		d := newDirect(t, adapter, idem.Options{})
		first, err := d.h(msg("order-1", "order 1"))
		require.NoError(t, err)
		require.Len(t, first, 1)
		again, err := d.h(msg("order-1", "order 1"))
		require.NoError(t, err)
		require.Len(t, again, 1)
		assert.Equal(t, first[0].UUID, again[0].UUID)
		assert.Equal(t, first[0].Payload, again[0].Payload)
		assert.Equal(t, first[0].Metadata, again[0].Metadata)
		assert.Equal(t, 1, count(t, d.ns.runs, ""))
		var source string
		require.NoError(t, db.QueryRow(`SELECT source FROM `+d.ns.table).Scan(&source))
		assert.Equal(t, idemwatermill.SourcePrefix+"direct", source, "no router: WithSource's name")
	})
}

func TestHandlerReturningNoMessagesReplaysNone(t *testing.T) {
	d := newDirect(t, "pgx", idem.Options{})
	m, err := idemwatermill.Middleware(mustMiddleware(t, d.ns.table), idemwatermill.WithSource("none"))
	require.NoError(t, err)
	h := m(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	for range 2 {
		out, err := h(msg("order-1", "order 1"))
		require.NoError(t, err)
		assert.Empty(t, out)
	}
	var body string
	require.NoError(t, db.QueryRow(`SELECT convert_from(response_body, 'UTF8') FROM `+d.ns.table).Scan(&body))
	assert.Equal(t, "[]", body)
}

func mustMiddleware(t *testing.T, table string) *idem.Middleware {
	t.Helper()
	mw, err := newMiddleware(t.Context(), "database/sql", dbURL, idem.Options{Table: table, Logger: (&logs{}).logger()}, t.Cleanup)
	require.NoError(t, err)
	return mw
}

func TestWithMetadataKey(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		d := newDirect(t, adapter, idem.Options{}, idemwatermill.WithMetadataKey("event_id"))
		first, err := d.h(msg("uuid-1", "order 1", "event_id", "order-1"))
		require.NoError(t, err)
		again, err := d.h(msg("uuid-2", "order 1", "event_id", "order-1"))
		require.NoError(t, err)
		assert.Equal(t, first[0].UUID, again[0].UUID, "a new UUID, the same event: a replay")
		assert.Equal(t, 1, count(t, d.ns.runs, ""))

		_, err = d.h(msg("uuid-3", "order 3"))
		assert.ErrorIs(t, err, idem.ErrInvalidKey)
		assert.True(t, idemwatermill.IsPermanent(err))
		assert.Equal(t, 1, count(t, d.ns.runs, ""))
	})
}

func TestWithDigest(t *testing.T) {
	// The publisher stamps the payload with its send time: the digest
	// covers what comes before it.
	before := func(m *message.Message) []byte { s, _, _ := strings.Cut(string(m.Payload), "@"); return []byte(s) }
	forAdapters(t, func(t *testing.T, adapter string) {
		d := newDirect(t, adapter, idem.Options{}, idemwatermill.WithDigest(before))
		first, err := d.h(msg("order-1", "order 1@10:00"))
		require.NoError(t, err)
		again, err := d.h(msg("order-1", "order 1@10:05"))
		require.NoError(t, err, "the digest leaves the stamp out")
		assert.Equal(t, first[0].UUID, again[0].UUID)
		_, err = d.h(msg("order-1", "order one@10:05"))
		assert.ErrorIs(t, err, idem.ErrPayloadMismatch)
		assert.True(t, idemwatermill.IsPermanent(err))
	})
}

func TestRetention(t *testing.T) {
	d := newDirect(t, "pgx", idem.Options{}, idemwatermill.WithRetention(time.Hour),
		idemwatermill.WithTimestamp(func(m *message.Message) (time.Time, bool) {
			t, err := time.Parse(time.RFC3339, m.Metadata.Get("sent"))
			return t, err == nil
		}))
	_, err := d.h(msg("order-1", "order 1", "sent", time.Now().Add(-2*time.Hour).Format(time.RFC3339)))
	assert.ErrorIs(t, err, idemwatermill.ErrTooOld)
	assert.True(t, idemwatermill.IsPermanent(err))
	_, err = d.h(msg("order-2", "order 2", "sent", time.Now().Add(-30*time.Minute).Format(time.RFC3339)))
	assert.NoError(t, err)
	_, err = d.h(msg("order-3", "order 3"))
	assert.NoError(t, err, "a message that does not say when it was sent is never too old")
	assert.Equal(t, 2, count(t, d.ns.runs, ""))

	off := newDirect(t, "pgx", idem.Options{}, idemwatermill.WithRetention(-1))
	_, err = off.h(msg("order-1", "order 1", idemwatermill.PublishedAtKey, time.Now().AddDate(-1, 0, 0).Format(time.RFC3339Nano)))
	assert.NoError(t, err, "a negative retention turns the check off")
}

// StampPublished sets PublishedAtKey on what a publisher sends, and keeps
// a time already set.
func TestStampPublished(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 2}, quiet)
	defer ps.Close()
	ms, err := ps.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	pub, err := idemwatermill.StampPublished(ps)
	require.NoError(t, err)
	before := time.Now()
	require.NoError(t, pub.Publish("t", msg("a", "a"), msg("b", "b", idemwatermill.PublishedAtKey, "2020-01-01T00:00:00Z")))
	a, b := <-ms, <-ms // in either order
	a.Ack()
	b.Ack()
	if a.UUID == "b" {
		a, b = b, a
	}
	at, err := time.Parse(time.RFC3339Nano, a.Metadata.Get(idemwatermill.PublishedAtKey))
	require.NoError(t, err)
	assert.False(t, at.Before(before.Truncate(time.Microsecond)))
	assert.Equal(t, "2020-01-01T00:00:00Z", b.Metadata.Get(idemwatermill.PublishedAtKey))
}

// A duplicate that finds its key in flight is held (Result.RetryAfter),
// then tried once more: here the original has committed meanwhile, and the
// duplicate returns its messages.
func TestInFlightDuplicateIsHeldThenReplayed(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		ns := newNames(t, false)
		l := &logs{}
		holding := make(chan struct{})
		var once sync.Once
		l.onLine = func(line string) {
			if strings.Contains(line, "holding the message") {
				once.Do(func() { close(holding) })
			}
		}
		mw, err := newMiddleware(t.Context(), adapter, dbURL, idem.Options{Table: ns.table, Lease: 5 * time.Second, Logger: l.logger()}, t.Cleanup)
		require.NoError(t, err)
		m, err := idemwatermill.Middleware(mw, idemwatermill.WithLogger(l.logger()), idemwatermill.WithSource("dup"))
		require.NoError(t, err)
		a := &app{db: db, ns: ns}
		running, release := make(chan struct{}), make(chan struct{})
		h := m(func(msg *message.Message) ([]*message.Message, error) {
			if msg.Metadata.Get("original") != "" {
				close(running)
				<-release
			}
			return a.handle(msg)
		})
		type result struct {
			out []*message.Message
			err error
		}
		orig := make(chan result, 1)
		go func() {
			out, err := h(msg("order-1", "order 1", "original", "yes"))
			orig <- result{out, err}
		}()
		<-running
		dup := make(chan result, 1)
		go func() {
			out, err := h(msg("order-1", "order 1"))
			dup <- result{out, err}
		}()
		<-holding
		close(release)
		o, d := <-orig, <-dup
		require.NoError(t, o.err)
		require.NoError(t, d.err, l.String())
		assert.Equal(t, o.out[0].UUID, d.out[0].UUID)
		assert.Equal(t, 1, count(t, ns.runs, ""))
	})
}

func TestPermanentAndIsPermanent(t *testing.T) {
	mine := errors.New("mine")
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{mine, false},
		{idemwatermill.Permanent(mine), true},
		{fmt.Errorf("wrapped: %w", idemwatermill.Permanent(mine)), true},
		{idemwatermill.ErrPermanent, true},
		{idem.ErrPayloadMismatch, false}, // as idem returns it: the middleware marks it
	} {
		assert.Equal(t, c.want, idemwatermill.IsPermanent(c.err), "%v", c.err)
	}
	assert.ErrorIs(t, idemwatermill.Permanent(mine), mine, "Permanent keeps the error in the chain")
	assert.Equal(t, "mine", idemwatermill.Permanent(mine).Error())
	assert.NoError(t, idemwatermill.Permanent(nil))
}

func TestMiddlewareRefusesBadArguments(t *testing.T) {
	_, err := idemwatermill.Middleware(nil)
	assert.ErrorContains(t, err, "*idem.Middleware")
	mw := mustMiddleware(t, newNames(t, false).table)
	_, err = idemwatermill.Middleware(mw, nil)
	assert.ErrorContains(t, err, "nil Option")
	_, err = idemwatermill.Middleware(mw, idemwatermill.WithRetryDelay(-time.Second))
	assert.ErrorContains(t, err, "WithRetryDelay")
	_, err = idemwatermill.Middleware(mw, idemwatermill.WithLogger(nil))
	assert.NoError(t, err, "a nil logger is slog.Default(), as in idemnats")
}

// Without a router's handler name in the message's context and without
// WithSource, every such use would share the source "watermill:": the
// message is refused, a permanent error that names WithSource, and
// nothing runs.
func TestNoSourceIsRefused(t *testing.T) {
	ns := newNames(t, false)
	l := &logs{}
	m, err := idemwatermill.Middleware(mustMiddleware(t, ns.table), idemwatermill.WithLogger(l.logger()))
	require.NoError(t, err)
	ran := false
	_, err = m(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })(msg("order-1", "order 1"))
	assert.ErrorContains(t, err, "WithSource")
	assert.True(t, idemwatermill.IsPermanent(err))
	assert.False(t, ran)
	assert.Zero(t, count(t, ns.table, ""))
	assert.True(t, l.has("level=ERROR", "permanent"), l.String())
}

// An error of idem's that a retry may fix (here the table is gone:
// ErrUnavailable) is held for Result.RetryAfter and tried once more before
// the error goes to the router (a nack), so that a short database outage
// does not spend the delivery limit; the handler never runs.
func TestARetryableErrorIsHeldThenTriedOnceMore(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		d := newDirect(t, adapter, idem.Options{RetryAfter: 10 * time.Millisecond})
		_, err := db.Exec(`DROP TABLE ` + d.ns.table)
		require.NoError(t, err)
		_, err = d.h(msg("order-1", "order 1"))
		require.ErrorIs(t, err, idem.ErrUnavailable)
		assert.False(t, idemwatermill.IsPermanent(err))
		assert.Equal(t, 1, strings.Count(d.logs.String(), "holding the message"), d.logs.String())
		assert.Zero(t, count(t, d.ns.runs, ""))
	})
}

// A handler's error (or panic) is held for WithRetryDelay before it goes
// to the router, which nacks it and most Pub/Subs redeliver at once: a
// failing handler is not run in a tight loop. Its Permanent errors are
// not held: they go to the poison queue.
func TestAHandlerErrorIsHeldForTheRetryDelay(t *testing.T) {
	delay := 300 * time.Millisecond
	d := newDirect(t, "pgx", idem.Options{}, idemwatermill.WithRetryDelay(delay))
	for _, body := range []string{"fail-once", "panic-once"} {
		start := time.Now()
		_, err := d.h(msg(body, body))
		require.Error(t, err)
		assert.False(t, idemwatermill.IsPermanent(err))
		assert.GreaterOrEqual(t, time.Since(start), delay, "held at least the delay")
		_, err = d.h(msg(body, body))
		require.NoError(t, err, "the redelivery runs and commits")
	}
	assert.Equal(t, 2, strings.Count(d.logs.String(), "holding the message, then nacked"))
	_, err := d.h(msg("p", "permanent"))
	assert.True(t, idemwatermill.IsPermanent(err))
	assert.Equal(t, 2, strings.Count(d.logs.String(), "holding the message, then nacked"), "a permanent error is not held")
	assert.Equal(t, 2, count(t, d.ns.ledger, ""))
}

// A panic in WithDigest's function is recovered, logged, and permanent:
// the handler does not run.
func TestAPanicInTheDigestIsPermanent(t *testing.T) {
	d := newDirect(t, "database/sql", idem.Options{}, idemwatermill.WithDigest(func(*message.Message) []byte { panic("cannot canonicalize") }))
	_, err := d.h(msg("order-1", "order 1"))
	assert.ErrorContains(t, err, "cannot canonicalize")
	assert.True(t, idemwatermill.IsPermanent(err))
	assert.True(t, d.logs.has("level=ERROR", "WithDigest function panicked"), d.logs.String())
	assert.Zero(t, count(t, d.ns.runs, ""))
}

func TestWithSourceAndPrefix(t *testing.T) {
	d := newDirect(t, "database/sql", idem.Options{}, idemwatermill.WithSourcePrefix("billing/"), idemwatermill.WithSource("ship"))
	_, err := d.h(msg("order-1", "order 1"))
	require.NoError(t, err)
	var source string
	require.NoError(t, db.QueryRow(`SELECT source FROM `+d.ns.table).Scan(&source))
	assert.Equal(t, "billing/watermill:ship", source)
}

// Produced messages too large to store with the answer roll everything
// back and are permanent: a redelivery would produce them again.
func TestProducedMessagesTooLargeArePermanent(t *testing.T) {
	d := newDirect(t, "pgx", idem.Options{MaxResponseBytes: 64})
	_, err := d.h(msg("order-1", strings.Repeat("x", 100)))
	assert.ErrorIs(t, err, idem.ErrResponseTooLarge)
	assert.True(t, idemwatermill.IsPermanent(err))
	assert.Zero(t, count(t, d.ns.ledger, ""))
	assert.Zero(t, count(t, d.ns.table, ""))
}
