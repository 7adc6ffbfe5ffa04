package idemnats_test

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

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The tests run against PostgreSQL (DATABASE_URL, default the local
// server), in a database of their own, and the NATS server with JetStream
// at NATS_URL (default nats://127.0.0.1:4222), on streams of their own;
// they fail when either is missing.
var (
	db      *sql.DB
	dbURL   string
	natsURL string
	nc      *nats.Conn
	js      jetstream.JetStream
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	natsURL = os.Getenv("NATS_URL")
	if natsURL == "" {
		natsURL = nats.DefaultURL
	}
	var err error
	nc, err = nats.Connect(natsURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemnats tests: NATS with JetStream is required at", natsURL+":", err)
		os.Exit(1)
	}
	js, err = jetstream.New(nc)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	u, drop, err := createDatabase("idemnats_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemnats tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(30)
	code := m.Run()
	db.Close()
	nc.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemnats tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemnats tests: goroutines left:", err)
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

// world is one test's idem table, ledger, run counter, stream and
// middleware.
type world struct {
	t       testing.TB
	adapter string
	table   string
	ledger  string // the handler's writes, in idem's transaction
	runs    string // one row per run of the handler, autocommitted outside it
	stream  string
	subject string
	opts    idem.Options
	mw      *idem.Middleware
	pool    *pgxpool.Pool
	logs    *syncBuffer // the idemnats logger's records
}

// newWorld builds a world; opts is the middleware's (Table and Logger are
// set here).
func newWorld(t testing.TB, adapter string, opts idem.Options) *world {
	t.Helper()
	n := seq.Add(1)
	w := &world{t: t, adapter: adapter, table: fmt.Sprintf("keys_%d", n), ledger: fmt.Sprintf("ledger_%d", n),
		runs: fmt.Sprintf("runs_%d", n), stream: fmt.Sprintf("IDEMNATS_%d_%d", os.Getpid(), n), logs: &syncBuffer{}}
	w.subject = strings.ToLower(w.stream) + ".in"
	require.NoError(t, idem.Migrate(t.Context(), db, w.table))
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (id bigserial PRIMARY KEY, event text NOT NULL, body text NOT NULL);
		CREATE TABLE ` + w.runs + ` (event text NOT NULL)`)
	require.NoError(t, err)
	_, err = js.CreateStream(t.Context(), jetstream.StreamConfig{Name: w.stream, Subjects: []string{w.subject},
		Duplicates: 100 * time.Millisecond}) // the least JetStream takes: tests publish an id again after it
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), w.stream) })
	opts.Table = w.table
	opts.Logger = slog.New(slog.NewTextHandler(w.logs, nil))
	w.opts = opts
	w.mw = w.middleware(opts)
	return w
}

// middleware builds a middleware on the world's adapter.
func (w *world) middleware(opts idem.Options) *idem.Middleware {
	if w.adapter != "pgx" {
		mw, err := idem.New(db, opts)
		require.NoError(w.t, err)
		return mw
	}
	if w.pool == nil {
		pool, err := pgxpool.New(context.Background(), dbURL)
		require.NoError(w.t, err)
		w.t.Cleanup(pool.Close)
		w.pool = pool
	}
	mw, err := idempgx.New(w.pool, opts)
	require.NoError(w.t, err)
	return mw
}

// consumer creates a durable consumer on the world's stream; cfg's zero
// fields get the tests' defaults (a name, AckWait 1s).
func (w *world) consumer(cfg jetstream.ConsumerConfig) jetstream.Consumer {
	w.t.Helper()
	if cfg.Durable == "" {
		cfg.Durable = "worker"
	}
	if cfg.AckWait == 0 {
		cfg.AckWait = time.Second
	}
	cons, err := js.CreateOrUpdateConsumer(context.Background(), w.stream, cfg)
	require.NoError(w.t, err)
	return cons
}

// handler builds the idemnats consumer of cons with fn (nil: write),
// logging to the world's buffer.
func (w *world) handler(cons jetstream.Consumer, fn idemnats.Handler, opts ...idemnats.Option) *idemnats.Consumer {
	w.t.Helper()
	if fn == nil {
		fn = w.write
	}
	opts = append([]idemnats.Option{idemnats.WithLogger(slog.New(slog.NewTextHandler(w.logs, &slog.HandlerOptions{Level: slog.LevelDebug})))}, opts...)
	c, err := idemnats.New(w.mw, cons, fn, opts...)
	require.NoError(w.t, err)
	return c
}

// write is the tests' handler: it counts its run outside the transaction
// and appends the message to the ledger inside it.
func (w *world) write(ctx context.Context, msg jetstream.Msg) error {
	key, _ := idem.KeyFromContext(ctx)
	if _, err := db.ExecContext(ctx, `INSERT INTO `+w.runs+` (event) VALUES ($1)`, key.EventID); err != nil {
		return err
	}
	return ledgerWrite(ctx, w.ledger, key.EventID, msg.Data())
}

// ledgerWrite appends one row in the claim's transaction, on either
// adapter.
func ledgerWrite(ctx context.Context, ledger, event string, body []byte) error {
	q := `INSERT INTO ` + ledger + ` (event, body) VALUES ($1, $2)`
	if tx, ok := idem.Tx(ctx); ok {
		_, err := tx.ExecContext(ctx, q, event, string(body))
		return err
	}
	if tx, ok := idempgx.Tx(ctx); ok {
		_, err := tx.Exec(ctx, q, event, string(body))
		return err
	}
	return fmt.Errorf("not inside idem's transaction")
}

// publish stores body in the stream, with Nats-Msg-Id id unless id is
// empty, and returns its stream sequence. A publication of an id again
// waits out the stream's duplicate window (there is no event for it).
func (w *world) publish(id string, body []byte) uint64 {
	w.t.Helper()
	m := nats.NewMsg(w.subject)
	m.Data = body
	if id != "" {
		m.Header.Set(jetstream.MsgIDHeader, id)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ack, err := js.PublishMsg(context.Background(), m)
		require.NoError(w.t, err)
		if !ack.Duplicate {
			return ack.Sequence
		}
		require.True(w.t, time.Now().Before(deadline), "the stream kept calling %q a duplicate", id)
		time.Sleep(25 * time.Millisecond)
	}
}

// next waits for the consumer's next delivery.
func next(t testing.TB, cons jetstream.Consumer) jetstream.Msg {
	t.Helper()
	msg, err := cons.Next(jetstream.FetchMaxWait(15 * time.Second))
	require.NoError(t, err)
	return msg
}

// count returns the number of rows of table where event = id (all rows
// for an empty id).
func (w *world) count(table, id string) int {
	w.t.Helper()
	var n int
	q, args := `SELECT count(*) FROM `+table, []any{}
	if id != "" {
		q, args = q+` WHERE event = $1`, []any{id}
	}
	require.NoError(w.t, db.QueryRow(q, args...).Scan(&n))
	return n
}

// keys is the number of keys in the idem table.
func (w *world) keys() int {
	var n int
	require.NoError(w.t, db.QueryRow(`SELECT count(*) FROM `+w.table).Scan(&n))
	return n
}

// info is the consumer's state on the server.
func info(t testing.TB, cons jetstream.Consumer) *jetstream.ConsumerInfo {
	t.Helper()
	ci, err := cons.Info(context.Background())
	require.NoError(t, err)
	return ci
}

// spy is a delivered message that records the answers given to JetStream
// and passes them on (unless drop is set for that answer).
type spy struct {
	jetstream.Msg
	mu         sync.Mutex
	answers    []string
	drop       map[string]bool
	inProgress chan struct{} // receives at each InProgress, if not nil
	onAck      func()        // called at Ack, if not nil
}

func (s *spy) record(a string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answers = append(s.answers, a)
	return !s.drop[a]
}

func (s *spy) got() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, a := range s.answers {
		if a != "InProgress" {
			out = append(out, a)
		}
	}
	return out
}

func (s *spy) Ack() error {
	if s.onAck != nil {
		s.onAck()
	}
	if !s.record("Ack") {
		return nil
	}
	return s.Msg.Ack()
}

func (s *spy) Nak() error {
	s.record("Nak")
	return s.Msg.Nak()
}

func (s *spy) NakWithDelay(d time.Duration) error {
	s.record("NakWithDelay")
	return s.Msg.NakWithDelay(d)
}

func (s *spy) Term() error {
	s.record("Term")
	return s.Msg.Term()
}

func (s *spy) InProgress() error {
	s.record("InProgress")
	err := s.Msg.InProgress()
	if s.inProgress != nil {
		select {
		case s.inProgress <- struct{}{}:
		default: // nobody is counting now
		}
	}
	return err
}

// syncBuffer is a bytes.Buffer safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func itoa(n uint64) string { return fmt.Sprint(n) }
