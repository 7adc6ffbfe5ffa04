package idemrabbitmq_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The tests run against PostgreSQL, in a database of their own
// (DATABASE_URL, default the local server), and RabbitMQ (RABBITMQ_URL,
// default amqp://guest:guest@127.0.0.1:5672/), on queues named
// idemrabbitmq_test_*, deleted at the end. They fail when either is
// missing.
var (
	db      *sql.DB
	dbURL   string
	amqpURL string
	conn    *amqp.Connection // the tests' own: publishing, declaring, the DLQ
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode)) // a consumer process of the crash tests
	}
	amqpURL = os.Getenv("RABBITMQ_URL")
	if amqpURL == "" {
		amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	var err error
	conn, err = amqp.Dial(amqpURL)
	if err != nil {
		fmt.Fprintf(os.Stderr, "idemrabbitmq tests: RabbitMQ is required at RABBITMQ_URL=%s: %v\n", amqpURL, err)
		os.Exit(1)
	}
	u, drop, err := createDatabase("idemrabbitmq_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemrabbitmq tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	code := m.Run()
	conn.Close()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemrabbitmq tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemrabbitmq tests: goroutines left:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var seq atomic.Int64

// adapters are the two ways to build a middleware: idem.New on
// database/sql, idempgx.New on a pgx pool.
var adapters = []string{"database/sql", "pgx"}

// forAdapters runs test once per adapter, in parallel.
func forAdapters(t *testing.T, test func(t *testing.T, adapter string)) {
	for _, a := range adapters {
		t.Run(a, func(t *testing.T) {
			t.Parallel()
			test(t, a)
		})
	}
}

// world is one test's tables (idem's, the ledger the handler writes, the
// runs it counts outside the transaction) and queues (the queue and its
// dead-letter queue, which the default exchange routes to).
type world struct {
	t      testing.TB
	name   string // the suffix of every table and queue of the world
	table  string
	ledger string
	runs   string
	queue  string
	dlq    string
	args   amqp.Table // the queue's arguments
}

// queueKind is how a world's queue is declared.
type queueKind struct {
	quorum bool
	limit  int // x-delivery-limit of a quorum queue; 0: none
}

func newWorld(t testing.TB, kind queueKind) *world {
	t.Helper()
	n := fmt.Sprintf("%d_%d", os.Getpid(), seq.Add(1))
	w := &world{t: t, name: n, table: "keys_" + n, ledger: "ledger_" + n, runs: "runs_" + n,
		queue: "idemrabbitmq_test_" + n, dlq: "idemrabbitmq_test_" + n + "_dlq"}
	require.NoError(t, idem.Migrate(context.Background(), db, w.table))
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (msg text NOT NULL, body text NOT NULL);
		CREATE TABLE ` + w.runs + ` (msg text NOT NULL)`)
	require.NoError(t, err)

	w.args = amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": w.dlq}
	if kind.quorum {
		w.args["x-queue-type"] = "quorum"
		if kind.limit > 0 {
			w.args["x-delivery-limit"] = kind.limit
		}
	}
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	_, err = ch.QueueDeclare(w.dlq, true, false, false, false, nil)
	require.NoError(t, err)
	_, err = ch.QueueDeclare(w.queue, true, false, false, false, w.args)
	require.NoError(t, err)
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			t.Error(err)
			return
		}
		defer ch.Close()
		for _, q := range []string{w.queue, w.dlq} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Error("delete queue", q, err)
			}
		}
	})
	return w
}

// middleware builds a middleware on the world's table with adapter, on a
// pool of its own closed at the end of the test.
func (w *world) middleware(adapter string, opts idem.Options) *idem.Middleware {
	w.t.Helper()
	mw, closePool, err := buildMiddleware(context.Background(), adapter, dbURL, w.table, opts)
	require.NoError(w.t, err)
	w.t.Cleanup(closePool)
	return mw
}

// buildMiddleware is a middleware on table through adapter (idem.New on
// database/sql, idempgx.New on a pgx pool), and the function that closes
// its pool.
func buildMiddleware(ctx context.Context, adapter, url, table string, opts idem.Options) (*idem.Middleware, func(), error) {
	opts.Table = table
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if adapter != "pgx" {
		d, err := sql.Open("pgx", url)
		if err != nil {
			return nil, nil, err
		}
		d.SetMaxOpenConns(10)
		mw, err := idem.New(d, opts)
		return mw, func() { d.Close() }, err
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, nil, err
	}
	mw, err := idempgx.New(pool, opts)
	return mw, pool.Close, err
}

// handlerFor is the tests' handler: it counts its run outside the
// transaction (an autocommit insert into runs), then writes the message's
// ledger row through the claim's transaction. A body "fail" makes it
// return an error after the write; "panic" panics after it.
func handlerFor(runs, ledger string, d0 *sql.DB) idemrabbitmq.Handler {
	return func(ctx context.Context, d amqp.Delivery) error {
		if _, err := d0.ExecContext(ctx, `INSERT INTO `+runs+` (msg) VALUES ($1)`, d.MessageId); err != nil {
			return err
		}
		if err := writeLedger(ctx, ledger, d); err != nil {
			return err
		}
		switch string(d.Body) {
		case "fail":
			return errors.New("the handler failed")
		case "panic":
			panic("the handler panicked")
		}
		return nil
	}
}

// writeLedger writes d's ledger row in the claim's transaction, on either
// adapter.
func writeLedger(ctx context.Context, ledger string, d amqp.Delivery) error {
	q := `INSERT INTO ` + ledger + ` (msg, body) VALUES ($1, $2)`
	if tx, ok := idem.Tx(ctx); ok {
		_, err := tx.ExecContext(ctx, q, d.MessageId, string(d.Body))
		return err
	}
	if tx, ok := idempgx.Tx(ctx); ok {
		_, err := tx.Exec(ctx, q, d.MessageId, string(d.Body))
		return err
	}
	return errors.New("not inside Do")
}

// count returns the rows of table (with msg = id, when id is set).
func count(t testing.TB, table, id string) int {
	t.Helper()
	var n int
	q, args := `SELECT count(*) FROM `+table, []any{}
	if id != "" {
		q, args = q+` WHERE msg = $1`, []any{id}
	}
	require.NoError(t, db.QueryRow(q, args...).Scan(&n))
	return n
}

// message is what the tests publish.
type message struct {
	id   string
	body string
	ts   time.Time
}

// publish sends msgs to the world's queue, persistent, and waits for the
// broker's confirms.
func (w *world) publish(msgs ...message) {
	w.t.Helper()
	ch, err := conn.Channel()
	require.NoError(w.t, err)
	defer ch.Close()
	require.NoError(w.t, ch.Confirm(false))
	var confirms []*amqp.DeferredConfirmation
	for _, m := range msgs {
		c, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", w.queue, false, false,
			amqp.Publishing{MessageId: m.id, Body: []byte(m.body), Timestamp: m.ts, DeliveryMode: amqp.Persistent})
		require.NoError(w.t, err)
		confirms = append(confirms, c)
	}
	for _, c := range confirms {
		ok, err := c.WaitContext(context.Background())
		require.NoError(w.t, err)
		require.True(w.t, ok, "the broker nacked a publish")
	}
}

// depth is how many messages the broker holds in queue: ready, and
// delivered but not acked.
func depth(t testing.TB, queue string) int {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages
}

// event is what a consumer did with a delivery.
type event struct {
	id     string
	action string // ack, nack, reject
}

// recorder forwards deliveries with an Acknowledger that reports every
// ack, nack and reject (after the broker's channel took it) on events.
type recorder struct {
	inner  amqp.Acknowledger
	id     string
	events chan<- event
}

func (r recorder) Ack(tag uint64, multiple bool) error {
	err := r.inner.Ack(tag, multiple)
	r.events <- event{r.id, "ack"}
	return err
}

func (r recorder) Nack(tag uint64, multiple, requeue bool) error {
	err := r.inner.Nack(tag, multiple, requeue)
	r.events <- event{r.id, "nack"}
	return err
}

func (r recorder) Reject(tag uint64, requeue bool) error {
	err := r.inner.Reject(tag, requeue)
	r.events <- event{r.id, "reject"}
	return err
}

// recorded wraps every delivery of in with a recorder.
func recorded(in <-chan amqp.Delivery, events chan<- event) <-chan amqp.Delivery {
	out := make(chan amqp.Delivery)
	go func() {
		defer close(out)
		for d := range in {
			d.Acknowledger = recorder{d.Acknowledger, d.MessageId, events}
			out <- d
		}
	}()
	return out
}

// consumer is a Consumer running on the world's queue in this process.
type consumer struct {
	events chan event
	logs   *syncBuffer
}

// consume runs a consumer of the world's queue with adapter until the
// test ends.
func (w *world) consume(adapter string, opts idem.Options, copts ...idemrabbitmq.Option) *consumer {
	w.t.Helper()
	c := &consumer{events: make(chan event, 100), logs: &syncBuffer{}}
	mw := w.middleware(adapter, opts)
	logger := slogTo(c.logs)
	copts = append([]idemrabbitmq.Option{idemrabbitmq.WithQueueArgs(w.args), idemrabbitmq.WithLogger(logger)}, copts...)
	cons, err := idemrabbitmq.New(mw, w.queue, handlerFor(w.runs, w.ledger, db), copts...)
	require.NoError(w.t, err)
	ch, err := conn.Channel()
	require.NoError(w.t, err)
	require.NoError(w.t, ch.Qos(4, 0, false))
	deliveries, err := ch.Consume(w.queue, "", false, false, false, false, nil)
	require.NoError(w.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx, recorded(deliveries, c.events)) }()
	w.t.Cleanup(func() {
		cancel()
		<-done
		ch.Close()
	})
	return c
}

// next waits for the consumer's next action.
func (c *consumer) next(t testing.TB) event {
	t.Helper()
	select {
	case e := <-c.events:
		return e
	case <-time.After(time.Minute):
		t.Fatalf("no ack, nack or reject within a minute; log:\n%s", c.logs.String())
		return event{}
	}
}

// dead is the next message of the world's dead-letter queue, and the
// reason it was dead-lettered (its x-death header).
func (w *world) dead() (amqp.Delivery, string) {
	w.t.Helper()
	ch, err := conn.Channel()
	require.NoError(w.t, err)
	defer ch.Close()
	require.NoError(w.t, ch.Qos(1, 0, false)) // take one message, leave the others
	msgs, err := ch.Consume(w.dlq, "", false, false, false, false, nil)
	require.NoError(w.t, err)
	select {
	case d := <-msgs:
		require.NoError(w.t, d.Ack(false))
		reason := ""
		if deaths, ok := d.Headers["x-death"].([]any); ok && len(deaths) > 0 {
			if t, ok := deaths[0].(amqp.Table); ok {
				reason, _ = t["reason"].(string)
			}
		}
		return d, reason
	case <-time.After(time.Minute):
		w.t.Fatal("nothing reached the dead-letter queue within a minute")
		return amqp.Delivery{}, ""
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writes (a log's).
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// lines returns the log lines that contain every one of parts.
func (s *syncBuffer) lines(parts ...string) []string {
	var out []string
	for l := range strings.SplitSeq(s.String(), "\n") {
		ok := l != ""
		for _, p := range parts {
			ok = ok && strings.Contains(l, p)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// slogTo is a debug-level text logger writing to b.
func slogTo(b *syncBuffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
