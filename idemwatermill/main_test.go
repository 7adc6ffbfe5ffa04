package idemwatermill_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The tests run on PostgreSQL, in a database of their own (DATABASE_URL,
// default the local server), and on RabbitMQ (AMQP_URL, default
// amqp://guest:guest@127.0.0.1:5672/), in queues named idemwatermill_test_*
// that they delete; they fail when either is missing. The same binary is
// the consumer process of the crash tests (helperEnv set: see
// process_test.go).
var (
	db      *sql.DB
	dbURL   string
	amqpURL string
	broker  *amqp.Connection
)

func TestMain(m *testing.M) {
	amqpURL = os.Getenv("AMQP_URL")
	if amqpURL == "" {
		amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	if os.Getenv(helperEnv) != "" {
		os.Exit(consumerMain())
	}
	u, drop, err := createDatabase("idemwatermill_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemwatermill tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	broker, err = amqp.Dial(amqpURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemwatermill tests: RabbitMQ is required at", amqpURL+":", err)
		db.Close()
		_ = drop()
		os.Exit(1)
	}
	code := m.Run()
	broker.Close()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemwatermill tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemwatermill tests: goroutines left:", err)
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

// newMiddleware builds idem's middleware on adapter, over dbURL's database,
// closing what it opened when ctx's test ends (cleanup).
func newMiddleware(ctx context.Context, adapter, url string, opts idem.Options, cleanup func(func())) (*idem.Middleware, error) {
	if adapter == "pgx" {
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			return nil, err
		}
		cleanup(pool.Close)
		return idempgx.New(pool, opts)
	}
	d, err := sql.Open("pgx", url)
	if err != nil {
		return nil, err
	}
	d.SetMaxOpenConns(10)
	cleanup(func() { d.Close() })
	return idem.New(d, opts)
}

// names are one test's table, ledger and runs tables and its queues.
type names struct {
	table, ledger, runs   string
	in, out, poison, dead string
}

// newNames creates a test's tables and declares its queues (deleted at the
// end). The ledger has no unique constraint: a second write of an event
// would show as a second row. runs counts the handler's runs outside the
// transaction (autocommit), with the UUID of the message each run produced.
func newNames(t *testing.T, quorum bool) names {
	t.Helper()
	n := seq.Add(1)
	p := fmt.Sprintf("idemwatermill_test_%d_%d", os.Getpid(), n)
	ns := names{table: fmt.Sprintf("keys_%d", n), ledger: fmt.Sprintf("ledger_%d", n), runs: fmt.Sprintf("runs_%d", n),
		in: p + "_in", out: p + "_out", poison: p + "_poison", dead: p + "_dead"}
	require.NoError(t, idem.Migrate(t.Context(), db, ns.table))
	_, err := db.Exec(`CREATE TABLE ` + ns.ledger + ` (event_id text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TABLE ` + ns.runs + ` (event_id text NOT NULL, produced text NOT NULL, pid int NOT NULL)`)
	require.NoError(t, err)
	ch, err := broker.Channel()
	require.NoError(t, err)
	defer ch.Close()
	for _, q := range []string{ns.out, ns.poison, ns.dead} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		require.NoError(t, err)
	}
	_, err = ch.QueueDeclare(ns.in, true, false, false, false, inArgs(quorum, ns.dead))
	require.NoError(t, err)
	t.Cleanup(func() {
		ch, err := broker.Channel()
		if err != nil {
			t.Errorf("delete queues: %v", err)
			return
		}
		defer ch.Close()
		for _, q := range []string{ns.in, ns.out, ns.poison, ns.dead} {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Errorf("delete queue %s: %v", q, err)
			}
		}
	})
	return ns
}

// inArgs are the input queue's arguments: a classic queue, or a quorum
// queue that dead-letters to dead once a message has been returned more
// than once (x-delivery-limit 1).
func inArgs(quorum bool, dead string) amqp.Table {
	if !quorum {
		return nil
	}
	return amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(1),
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
}

// amqpConfig is watermill's durable queue configuration, the topic being
// the queue's name, with the queue's arguments; publishing waits for the
// broker's confirmation.
func amqpConfig(args amqp.Table) wamqp.Config {
	c := wamqp.NewDurableQueueConfig(amqpURL)
	c.Queue.Arguments = args
	c.Marshaler = headerMarshaler{}
	c.Publish.ConfirmDelivery = true
	return c
}

// headerMarshaler is watermill-amqp's DefaultMarshaler for any headers: a
// quorum queue's redelivery carries x-delivery-count, a number, which
// DefaultMarshaler refuses (metadata are strings) and nacks, spending the
// delivery budget. Headers that are not strings become their text.
type headerMarshaler struct{ wamqp.DefaultMarshaler }

func (m headerMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	h := make(amqp.Table, len(d.Headers))
	for k, v := range d.Headers {
		if _, ok := v.(string); !ok {
			v = fmt.Sprint(v)
		}
		h[k] = v
	}
	d.Headers = h
	return m.DefaultMarshaler.Unmarshal(d)
}

// count is the number of rows of table matching where (true if empty).
func count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	if where == "" {
		where = "true"
	}
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+table+` WHERE `+where, args...).Scan(&n))
	return n
}

// queued is the number of messages ready in queue, by the broker's own
// count (a passive declare).
func queued(t *testing.T, queue string) int {
	t.Helper()
	ch, err := broker.Channel()
	require.NoError(t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages
}

// delivery is a message taken off an observed queue: its watermill UUID,
// headers and body.
type delivery struct {
	uuid    string
	headers amqp.Table
	body    string
}

// watcher consumes a queue (auto-ack) and hands out its messages.
type watcher struct {
	t    *testing.T
	ch   *amqp.Channel
	tag  string
	ds   chan delivery
	done chan struct{}
}

// watch consumes queue until rest (or the test's end).
func watch(t *testing.T, queue string) *watcher {
	t.Helper()
	ch, err := broker.Channel()
	require.NoError(t, err)
	w := &watcher{t: t, ch: ch, tag: fmt.Sprintf("watch-%d", seq.Add(1)), ds: make(chan delivery, 4096), done: make(chan struct{})}
	in, err := ch.Consume(queue, w.tag, true, false, false, false, nil)
	require.NoError(t, err)
	go func() {
		defer close(w.done)
		for d := range in {
			u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			w.ds <- delivery{uuid: u, headers: d.Headers, body: string(d.Body)}
		}
	}()
	t.Cleanup(func() {
		ch.Close()
		<-w.done
	})
	return w
}

// next waits for the queue's next message.
func (w *watcher) next(what string) delivery {
	w.t.Helper()
	select {
	case d := <-w.ds:
		return d
	case <-time.After(20 * time.Second):
		w.t.Fatalf("no message on the %s queue within 90s", what)
		return delivery{}
	}
}

// rest stops consuming (the broker confirms: what it sent before is
// received) and returns the messages received and not yet taken by next.
func (w *watcher) rest() []delivery {
	w.t.Helper()
	require.NoError(w.t, w.ch.Cancel(w.tag, false))
	<-w.done
	var ds []delivery
	for {
		select {
		case d := <-w.ds:
			ds = append(ds, d)
		default:
			return ds
		}
	}
}

// publish sends body with uuid and metadata (key, value, ...) to queue,
// as watermill's AMQP publisher does.
func publish(t *testing.T, queue, uuid, body string, metadata ...string) {
	t.Helper()
	ch, err := broker.Channel()
	require.NoError(t, err)
	defer ch.Close()
	publishOn(t, ch, queue, uuid, body, metadata...)
}

func publishOn(t *testing.T, ch *amqp.Channel, queue, uuid, body string, metadata ...string) {
	t.Helper()
	h := amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: uuid}
	for i := 0; i+1 < len(metadata); i += 2 {
		h[metadata[i]] = metadata[i+1]
	}
	require.NoError(t, ch.PublishWithContext(t.Context(), "", queue, false, false,
		amqp.Publishing{Headers: h, Body: []byte(body), DeliveryMode: amqp.Persistent}))
}

// logs is a slog handler's output that tests can read while it is written.
type logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
	// onLine, when set, is called with each line written.
	onLine func(line string)
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	n, err := l.buf.Write(p)
	l.mu.Unlock()
	if l.onLine != nil {
		l.onLine(string(p))
	}
	return n, err
}

func (l *logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// has reports whether a line holds every one of parts.
func (l *logs) has(parts ...string) bool {
	for line := range strings.SplitSeq(l.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}

func (l *logs) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// quiet is watermill's logger in the tests.
var quiet = watermill.NopLogger{}
