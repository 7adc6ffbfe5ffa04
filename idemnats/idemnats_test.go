package idemnats_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewMessageIsAckedAfterCommitAndARedeliveryIsReplayed(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{})
		c := w.handler(cons, nil)
		w.publish("order-1", []byte(`{"order":1}`))

		// The first delivery commits, but its ack never reaches the
		// server (a crash after COMMIT): JetStream redelivers after AckWait.
		first := &spy{Msg: next(t, cons), drop: map[string]bool{"Ack": true}}
		require.NoError(t, c.HandleContext(t.Context(), first))
		assert.Equal(t, []string{"Ack"}, first.got())
		assert.Equal(t, 1, w.count(w.ledger, "order-1"))

		again := &spy{Msg: next(t, cons)}
		meta, err := again.Metadata()
		require.NoError(t, err)
		assert.EqualValues(t, 2, meta.NumDelivered)
		require.NoError(t, c.HandleContext(t.Context(), again))
		assert.Equal(t, []string{"Ack"}, again.got())
		assert.Equal(t, 1, w.count(w.ledger, "order-1"), "one ledger row")
		assert.Equal(t, 1, w.count(w.runs, "order-1"), "the redelivery is a replay: the handler did not run")

		// The publisher sends the same id again, past the stream's
		// duplicate window: another stream sequence, the same key.
		w.publish("order-1", []byte(`{"order":1}`))
		third := &spy{Msg: next(t, cons)}
		require.NoError(t, c.HandleContext(t.Context(), third))
		assert.Equal(t, []string{"Ack"}, third.got())
		assert.Equal(t, 1, w.count(w.runs, "order-1"))
		assert.Equal(t, 1, w.count(w.ledger, ""))

		eventually(t, "nothing left unacked", settled(t, cons))
		assert.Contains(t, w.logs.String(), "replayed=true")
	})
}

func TestAMessageWithoutMsgIDIsKeyedByStreamSequence(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{})
		c := w.handler(cons, nil)
		s1 := w.publish("", []byte("a"))
		s2 := w.publish("", []byte("a")) // published twice without an id: two messages

		for _, want := range []uint64{s1, s2} {
			m := next(t, cons)
			key, err := c.Key(m)
			require.NoError(t, err)
			created := strconv.FormatInt(info(t, cons).Created.UnixNano(), 10)
			assert.Equal(t, idem.Key{Source: "nats:" + w.stream + "/worker", EventID: w.stream + ":" + created + ":" + itoa(want)}, key)
			require.NoError(t, c.HandleContext(t.Context(), m))
		}
		assert.Equal(t, 2, w.count(w.ledger, ""))
		eventually(t, "nothing left unacked", settled(t, cons))
	})
}

func TestAStreamCreatedAgainDoesNotReplayItsNewMessagesWithoutMsgID(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{})
		c := w.handler(cons, nil)
		require.EqualValues(t, 1, w.publish("", []byte("before")))
		require.NoError(t, c.HandleContext(t.Context(), next(t, cons)))

		// The stream is deleted and created again: its sequence restarts
		// at 1, and so does the consumer's creation time.
		require.NoError(t, js.DeleteStream(t.Context(), w.stream))
		_, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: w.stream, Subjects: []string{w.subject}})
		require.NoError(t, err)
		cons = w.consumer(jetstream.ConsumerConfig{})
		c = w.handler(cons, nil)
		require.EqualValues(t, 1, w.publish("", []byte("after")))
		m := &spy{Msg: next(t, cons)}
		require.NoError(t, c.HandleContext(t.Context(), m), "a new message, not a mismatch with the old one")
		assert.Equal(t, []string{"Ack"}, m.got())
		assert.Equal(t, 2, w.count(w.runs, ""), "the new message ran: it was not replayed")
		assert.Equal(t, 2, w.count(w.ledger, ""))
		assert.Equal(t, 2, w.keys())
	})
}

func TestAPayloadMismatchIsTerminatedAndLogged(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{})
		c := w.handler(cons, nil)
		w.publish("order-2", []byte("first"))
		require.NoError(t, c.HandleContext(t.Context(), next(t, cons)))

		w.publish("order-2", []byte("second")) // the id reused for another body
		m := &spy{Msg: next(t, cons)}
		err := c.HandleContext(t.Context(), m)
		require.ErrorIs(t, err, idem.ErrPayloadMismatch)
		assert.Equal(t, []string{"Term"}, m.got())
		assert.Equal(t, 1, w.count(w.ledger, ""))
		assert.Equal(t, 1, w.count(w.runs, ""))
		assert.Contains(t, w.logs.String(), "level=ERROR msg=\"idemnats: terminated")
		eventually(t, "the terminated message is not redelivered", settled(t, cons))
	})
}

func TestAHandlerErrorOrPanicIsRolledBackAndNakedWithADelay(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"error", "panic"} {
		t.Run(how, func(t *testing.T) {
			forAdapters(t, func(t *testing.T, adapter string) {
				w := newWorld(t, adapter, idem.Options{})
				cons := w.consumer(jetstream.ConsumerConfig{})
				fails := true
				c := w.handler(cons, func(ctx context.Context, msg jetstream.Msg) error {
					if err := w.write(ctx, msg); err != nil {
						return err
					}
					if fails {
						fails = false
						if how == "panic" {
							panic("bad message")
						}
						return errors.New("downstream unavailable")
					}
					return nil
				}, idemnats.WithRetryDelay(50*time.Millisecond))
				w.publish("order-3", []byte("x"))

				m := &spy{Msg: next(t, cons)}
				err := c.HandleContext(t.Context(), m)
				require.Error(t, err)
				assert.Equal(t, []string{"NakWithDelay"}, m.got())
				assert.Zero(t, w.count(w.ledger, ""), "the handler's write rolled back")
				assert.Zero(t, w.keys(), "nothing stored")
				if how == "panic" {
					assert.Contains(t, w.logs.String(), "the handler panicked")
				}

				// Redelivered after the delay, it runs again and commits.
				again := &spy{Msg: next(t, cons)}
				require.NoError(t, c.HandleContext(t.Context(), again))
				assert.Equal(t, []string{"Ack"}, again.got())
				assert.Equal(t, 1, w.count(w.ledger, ""))
				assert.Equal(t, 2, w.count(w.runs, ""))
				eventually(t, "nothing left unacked", settled(t, cons))
			})
		})
	}
}

func TestBadInputIsTerminatedLoggedAndNothingIsWritten(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, id string
		body     []byte
		want     error
	}{
		{"a Nats-Msg-Id over 255 bytes", strings.Repeat("k", 256), []byte("x"), idem.ErrInvalidKey},
		{"a Nats-Msg-Id that is not UTF-8", "bad\xff", []byte("x"), idem.ErrInvalidKey},
		{"a body over MaxBodyBytes", "big", make([]byte, 2048), idem.ErrBodyTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			forAdapters(t, func(t *testing.T, adapter string) {
				w := newWorld(t, adapter, idem.Options{MaxBodyBytes: 1024})
				cons := w.consumer(jetstream.ConsumerConfig{})
				c := w.handler(cons, nil)
				w.publish(tc.id, tc.body)
				m := &spy{Msg: next(t, cons)}
				require.ErrorIs(t, c.HandleContext(t.Context(), m), tc.want)
				assert.Equal(t, []string{"Term"}, m.got())
				assert.Zero(t, w.count(w.runs, ""), "the handler did not run")
				assert.Zero(t, w.count(w.ledger, ""))
				assert.Zero(t, w.keys())
				assert.Contains(t, w.logs.String(), "idemnats: terminated")
				eventually(t, "nothing left unacked", settled(t, cons))
			})
		})
	}
}

func TestAMessageOlderThanTheRetentionIsTerminatedWithoutRunning(t *testing.T) {
	t.Parallel()
	w := newWorld(t, "database/sql", idem.Options{})
	cons := w.consumer(jetstream.ConsumerConfig{})
	c := w.handler(cons, nil, idemnats.WithRetention(time.Nanosecond))
	w.publish("old", []byte("x"))
	m := &spy{Msg: next(t, cons)}
	require.ErrorIs(t, c.HandleContext(t.Context(), m), idemnats.ErrTooOld)
	assert.Equal(t, []string{"Term"}, m.got())
	assert.Zero(t, w.count(w.runs, ""))
	assert.Zero(t, w.keys())
	assert.Contains(t, w.logs.String(), "older than the retention")
}

func TestNewRefusesAConsumerThatCannotKeepKeys(t *testing.T) {
	t.Parallel()
	w := newWorld(t, "database/sql", idem.Options{})
	ctx := t.Context()
	eph, err := js.CreateOrUpdateConsumer(ctx, w.stream, jetstream.ConsumerConfig{})
	require.NoError(t, err)
	_, err = idemnats.New(w.mw, eph, w.write)
	require.ErrorIs(t, err, idemnats.ErrConsumer)
	assert.Contains(t, err.Error(), "ephemeral")

	named, err := js.CreateOrUpdateConsumer(ctx, w.stream, jetstream.ConsumerConfig{Name: "named-but-not-durable", InactiveThreshold: time.Minute})
	require.NoError(t, err)
	_, err = idemnats.New(w.mw, named, w.write)
	require.ErrorIs(t, err, idemnats.ErrConsumer)

	ackAll := w.consumer(jetstream.ConsumerConfig{Durable: "ackall", AckPolicy: jetstream.AckAllPolicy})
	_, err = idemnats.New(w.mw, ackAll, w.write)
	require.ErrorIs(t, err, idemnats.ErrConsumer)
	assert.Contains(t, err.Error(), "AckExplicit")

	ok := w.consumer(jetstream.ConsumerConfig{Durable: "ok", MaxDeliver: 3})
	_, err = idemnats.New(w.mw, ok, w.write, idemnats.WithSourcePrefix("bad\nprefix"))
	require.Error(t, err)
	c, err := idemnats.New(w.mw, ok, w.write, idemnats.WithSourcePrefix("billing/"))
	require.NoError(t, err)
	assert.Equal(t, "billing/nats:"+w.stream+"/ok", c.Source())
}

func TestAHandlerLongerThanAckWaitKeepsItsMessage(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{AckWait: 500 * time.Millisecond})
		w.publish("slow", []byte("x"))
		m := &spy{Msg: next(t, cons), inProgress: make(chan struct{}, 1)}
		slow := func(ctx context.Context, msg jetstream.Msg) error {
			for range 4 { // two AckWaits
				<-m.inProgress
			}
			return w.write(ctx, msg)
		}
		c := w.handler(cons, slow)
		require.NoError(t, c.HandleContext(t.Context(), m))
		assert.Zero(t, info(t, cons).NumRedelivered, "the message was not redelivered while its handler ran")
		eventually(t, "the message acked", settled(t, cons))
		assert.Equal(t, 1, w.count(w.ledger, ""))
	})
}

func TestLeaseModeHeartbeatExtendsTheLeaseWithInProgress(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{Lease: 1200 * time.Millisecond, HandlerTimeout: 20 * time.Second, LockWait: -1})
		cons := w.consumer(jetstream.ConsumerConfig{AckWait: 600 * time.Millisecond})
		w.publish("long-job", []byte("x"))
		m := &spy{Msg: next(t, cons), inProgress: make(chan struct{}, 1)}
		var duplicate error
		other := w.middleware(w.opts)
		c := w.handler(cons, func(ctx context.Context, msg jetstream.Msg) error {
			if err := w.write(ctx, msg); err != nil {
				return err
			}
			for range 5 { // 1.5s: past the lease, had it not been extended
				<-m.inProgress
			}
			// The duplicate goes through a second middleware on the same
			// table (another process): only the lease in PostgreSQL can
			// refuse it, not this middleware's own one-delivery check.
			key, _ := idem.KeyFromContext(ctx)
			_, duplicate = other.Do(context.Background(), key, msg.Data(), func(context.Context) ([]byte, error) {
				return nil, errors.New("a duplicate took the key over")
			})
			return nil
		})
		require.NoError(t, c.HandleContext(t.Context(), m))
		require.ErrorIs(t, duplicate, idem.ErrInFlight, "the lease was alive: the duplicate did not take over")
		assert.Equal(t, []string{"Ack"}, m.got())
		assert.Equal(t, 1, w.count(w.ledger, ""))
		assert.Zero(t, info(t, cons).NumRedelivered)
	})
}

func TestWithLeaseBeatsALeaseShorterThanHalfTheAckWait(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		lease := 600 * time.Millisecond
		w := newWorld(t, adapter, idem.Options{Lease: lease, HandlerTimeout: 20 * time.Second, LockWait: -1})
		cons := w.consumer(jetstream.ConsumerConfig{AckWait: 4 * time.Second}) // half of it: past the lease
		w.publish("short-lease", []byte("x"))
		m := &spy{Msg: next(t, cons), inProgress: make(chan struct{}, 1)}
		var expired int
		c := w.handler(cons, func(ctx context.Context, msg jetstream.Msg) error {
			for range 3 {
				<-m.inProgress // a beat: InProgress, then ExtendLease
				var alive bool
				if err := db.QueryRowContext(ctx, `SELECT lease_until > clock_timestamp() FROM `+w.table).Scan(&alive); err != nil {
					return err
				}
				if !alive {
					expired++
				}
			}
			return w.write(ctx, msg)
		}, idemnats.WithLease(lease))
		require.NoError(t, c.HandleContext(t.Context(), m))
		assert.Zero(t, expired, "the lease was still running at every beat")
		assert.Equal(t, 1, w.count(w.ledger, ""))
	})
}

func TestAPanicInTheDigestIsTerminatedAndLogged(t *testing.T) {
	t.Parallel()
	w := newWorld(t, "database/sql", idem.Options{})
	cons := w.consumer(jetstream.ConsumerConfig{})
	c := w.handler(cons, nil, idemnats.WithDigest(func(jetstream.Msg) []byte { panic("cannot canonicalize") }))
	w.publish("digest-panics", []byte("x"))
	m := &spy{Msg: next(t, cons)}
	require.ErrorContains(t, c.HandleContext(t.Context(), m), "cannot canonicalize")
	assert.Equal(t, []string{"Term"}, m.got())
	assert.Zero(t, w.count(w.runs, ""), "the handler did not run")
	assert.Zero(t, w.keys())
	assert.Contains(t, w.logs.String(), "the WithDigest function panicked")
	eventually(t, "nothing left unacked", settled(t, cons))
}

func TestWithDigestServesAPublisherThatReencodes(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{})
		// The publisher encodes the same order with its fields in any
		// order; the digest is over a canonical form.
		canonical := func(msg jetstream.Msg) []byte {
			var v map[string]any
			if err := json.Unmarshal(msg.Data(), &v); err != nil {
				return msg.Data()
			}
			b, _ := json.Marshal(v) // map keys sorted
			return b
		}
		c := w.handler(cons, nil, idemnats.WithDigest(canonical))
		w.publish("order-4", []byte(`{"sku":"A1","qty":2}`))
		require.NoError(t, c.HandleContext(t.Context(), next(t, cons)))
		w.publish("order-4", []byte(`{"qty":2,"sku":"A1"}`))
		m := &spy{Msg: next(t, cons)}
		require.NoError(t, c.HandleContext(t.Context(), m), "replayed, not a mismatch")
		assert.Equal(t, []string{"Ack"}, m.got())
		assert.Equal(t, 1, w.count(w.runs, ""))
		assert.Equal(t, 1, w.count(w.ledger, ""))
	})
}
