package idemrabbitmq_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The crash tests run consumers in processes of their own, the test binary
// re-executed with helperEnv set to a mode (TestMain hands it to
// helperMain), and kill them with SIGKILL. A helper writes a line to its
// stdout for every step the test waits for:
//
//	WROTE <id>      crash-before-commit: the handler wrote its ledger row, not committed; it then hangs
//	COMMITTED <id>  crash-after-commit: Do committed, the ack is about to go; it then hangs instead
//	ACK <id>, NACK <id>, REJECT <id>  what it did with a delivery
const helperEnv = "IDEMRABBITMQ_HELPER"

// helperMain is a consumer process: the world's queue, table and ledger
// come from its environment. It runs until SIGTERM (or SIGKILL).
func helperMain(mode string) int {
	env := func(k string) string { return os.Getenv("IDEMRABBITMQ_" + k) }
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "helper:", err); return 2 }
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	lease, _ := time.ParseDuration(env("LEASE"))
	concurrency, _ := strconv.Atoi(env("CONCURRENCY"))
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	mw, closePool, err := buildMiddleware(ctx, env("ADAPTER"), env("DB"), env("TABLE"), idem.Options{Lease: lease, Logger: logger})
	if err != nil {
		return fail(err)
	}
	defer closePool()
	runsDB, err := sql.Open("pgx", env("DB"))
	if err != nil {
		return fail(err)
	}
	defer runsDB.Close()
	c, err := amqp.Dial(env("AMQP"))
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	ch, err := c.Channel()
	if err != nil {
		return fail(err)
	}
	if err := ch.Qos(2*concurrency, 0, false); err != nil {
		return fail(err)
	}
	deliveries, err := ch.Consume(env("QUEUE"), "", false, false, false, false, nil)
	if err != nil {
		return fail(err)
	}

	var out sync.Mutex // one line at a time on stdout
	say := func(format string, args ...any) {
		out.Lock()
		defer out.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...)
	}
	h := handlerFor(env("RUNS"), env("LEDGER"), runsDB)
	if mode == "crash-before-commit" {
		inner := h
		h = func(ctx context.Context, d amqp.Delivery) error {
			if err := inner(ctx, d); err != nil {
				return err
			}
			say("WROTE %s", d.MessageId)
			select {} // until killed
		}
	}
	wrapped := make(chan amqp.Delivery)
	go func() {
		defer close(wrapped)
		for d := range deliveries {
			d.Acknowledger = helperAck{d.Acknowledger, d.MessageId, mode == "crash-after-commit", say}
			wrapped <- d
		}
	}()
	cons, err := idemrabbitmq.New(mw, env("QUEUE"), h, idemrabbitmq.WithConcurrency(concurrency),
		idemrabbitmq.WithDeadLetterExchange(""), idemrabbitmq.WithLogger(logger))
	if err != nil {
		return fail(err)
	}
	_ = cons.Run(ctx, wrapped)
	return 0
}

// helperAck reports a helper's acks, nacks and rejects on stdout; with
// hang, it hangs at the first ack instead (after the COMMIT, before the
// ack).
type helperAck struct {
	inner amqp.Acknowledger
	id    string
	hang  bool
	say   func(format string, args ...any)
}

func (a helperAck) Ack(tag uint64, multiple bool) error {
	if a.hang {
		a.say("COMMITTED %s", a.id)
		select {} // until killed
	}
	err := a.inner.Ack(tag, multiple)
	a.say("ACK %s", a.id)
	return err
}

func (a helperAck) Nack(tag uint64, multiple, requeue bool) error {
	err := a.inner.Nack(tag, multiple, requeue)
	a.say("NACK %s", a.id)
	return err
}

func (a helperAck) Reject(tag uint64, requeue bool) error {
	err := a.inner.Reject(tag, requeue)
	a.say("REJECT %s", a.id)
	return err
}

// proc is a running helper process.
type proc struct {
	cmd    *exec.Cmd
	lines  chan string // its stdout, line by line
	stderr *syncBuffer
	done   chan struct{}
}

// startHelper starts a consumer process of the world's queue.
func (w *world) startHelper(mode, adapter string, concurrency int, lease time.Duration) *proc {
	w.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode,
		"IDEMRABBITMQ_DB="+dbURL, "IDEMRABBITMQ_AMQP="+amqpURL, "IDEMRABBITMQ_ADAPTER="+adapter,
		"IDEMRABBITMQ_TABLE="+w.table, "IDEMRABBITMQ_LEDGER="+w.ledger, "IDEMRABBITMQ_RUNS="+w.runs,
		"IDEMRABBITMQ_QUEUE="+w.queue, "IDEMRABBITMQ_CONCURRENCY="+strconv.Itoa(concurrency),
		"IDEMRABBITMQ_LEASE="+lease.String())
	p := &proc{cmd: cmd, lines: make(chan string, 10000), stderr: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(w.t, err)
	require.NoError(w.t, cmd.Start())
	go func() {
		defer close(p.done)
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			p.lines <- s.Text()
		}
		close(p.lines)
	}()
	w.t.Cleanup(func() {
		if cmd.ProcessState == nil { // still running: the test failed midway
			_ = cmd.Process.Kill()
			<-p.done
			_ = cmd.Wait()
		}
	})
	return p
}

// expect waits for the helper's line want, skipping others.
func (p *proc) expect(t testing.TB, want string) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				t.Fatalf("the helper ended before %q; its log:\n%s", want, p.stderr.String())
			}
			if l == want {
				return
			}
		case <-deadline:
			t.Fatalf("no %q from the helper within 60s; its log:\n%s", want, p.stderr.String())
		}
	}
}

// kill ends the helper with SIGKILL.
func (p *proc) kill(t testing.TB) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Kill())
	<-p.done
	_ = p.cmd.Wait()
}

// stop ends the helper with SIGTERM, and waits for it to exit cleanly.
func (p *proc) stop(t testing.TB) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	for range p.lines { // drain, so that the reader can end
	}
	<-p.done
	require.NoError(t, p.cmd.Wait(), p.stderr.String())
}

// TestConsumerKilled: a consumer process killed with SIGKILL (a) in the
// handler, after its write, before the COMMIT; (b) after the COMMIT,
// before the ack. RabbitMQ redelivers the message to another consumer
// process; its ledger row exists exactly once, and in (b) the handler did
// not run again (a replay).
func TestConsumerKilled(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode, line   string
		ledgerAtKill int
		runs         int
	}{
		{"crash-before-commit", "WROTE", 0, 2},
		{"crash-after-commit", "COMMITTED", 1, 1},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			t.Parallel()
			forAdapters(t, func(t *testing.T, adapter string) {
				w := newWorld(t, queueKind{})
				w.publish(message{id: "k1", body: "hello"})
				first := w.startHelper(tc.mode, adapter, 1, 0)
				first.expect(t, tc.line+" k1")
				assert.Equal(t, tc.ledgerAtKill, count(t, w.ledger, "k1"), "the ledger when the consumer is killed")
				first.kill(t)

				second := w.startHelper("serve", adapter, 1, 0)
				second.expect(t, "ACK k1")
				second.stop(t)
				assert.Equal(t, 1, count(t, w.ledger, "k1"), "exactly once")
				assert.Equal(t, tc.runs, count(t, w.runs, "k1"), "the handler's runs")
				assert.Zero(t, depth(t, w.queue))
				assert.Zero(t, depth(t, w.dlq))
			})
		})
	}
}

// TestInFlightKeepsTheDeliveryBudget: in lease mode, a consumer killed in
// its handler leaves the key claimed until its lease runs out; RabbitMQ
// redelivers the message at once. The redelivery is held, not requeued,
// until the lease's end, then taken over and processed, on a quorum queue
// whose delivery limit a single requeue would exceed.
func TestInFlightKeepsTheDeliveryBudget(t *testing.T) {
	t.Parallel()
	const lease = 5 * time.Second // long enough to be live still when the redelivery comes, on a loaded machine
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, queueKind{quorum: true, limit: 1})
		w.publish(message{id: "f1", body: "hello"})
		first := w.startHelper("crash-before-commit", adapter, 1, lease)
		first.expect(t, "WROTE f1")
		first.kill(t)

		// The consumer's own lease is longer: its run, after the takeover,
		// must not time out on a loaded machine.
		c := w.consume(adapter, idem.Options{Lease: 4 * lease, LockWait: 50 * time.Millisecond})
		assert.Equal(t, event{"f1", "ack"}, c.next(t))
		assert.NotEmpty(t, c.logs.lines("level=DEBUG", "held", "message_id=f1"), c.logs.String())
		assert.Equal(t, 1, count(t, w.ledger, "f1"))
		assert.Equal(t, 2, count(t, w.runs, "f1"))
		assert.Zero(t, depth(t, w.dlq), "not dead-lettered")

		// The limit is real: a message returned by a consumer that went
		// away, then requeued once, is dead-lettered.
		w2 := newWorld(t, queueKind{quorum: true, limit: 1})
		w2.publish(message{id: "f2", body: "x"})
		ch, err := conn.Channel()
		require.NoError(t, err)
		msgs, err := ch.Consume(w2.queue, "", false, false, false, false, nil)
		require.NoError(t, err)
		<-msgs
		require.NoError(t, ch.Close()) // unacked: returned to the queue
		ch, err = conn.Channel()
		require.NoError(t, err)
		defer ch.Close()
		msgs, err = ch.Consume(w2.queue, "", false, false, false, false, nil)
		require.NoError(t, err)
		d := <-msgs
		require.NoError(t, d.Nack(false, true))
		dead, reason := w2.dead()
		assert.Equal(t, "f2", dead.MessageId)
		assert.Equal(t, "delivery_limit", reason)
	})
}

// TestStorm: 1,000 messages, each published 3 times, to 3 consumer
// processes (two on database/sql, one on pgx, 4 deliveries at once each):
// every message's ledger row exactly once, its handler run once, every
// delivery acked, and the broker's own counters show nothing left, ready
// or unacked, and nothing dead-lettered.
func TestStorm(t *testing.T) {
	t.Parallel()
	const messages, copies = 1000, 3
	w := newWorld(t, queueKind{})
	var procs []*proc
	for _, adapter := range []string{"database/sql", "pgx", "database/sql"} {
		procs = append(procs, w.startHelper("serve", adapter, 4, 0))
	}
	var pub []message
	for c := range copies {
		for i := range messages {
			pub = append(pub, message{id: fmt.Sprintf("s%d", i), body: fmt.Sprintf("body %d", i), ts: time.Now()})
		}
		_ = c
	}
	w.publish(pub...)

	acks := map[string]int{}
	var rejects, nacks int
	lines := make(chan string)
	var readers sync.WaitGroup
	stopReading := make(chan struct{})
	for _, p := range procs {
		readers.Go(func() {
			for {
				select {
				case l := <-p.lines:
					select {
					case lines <- l:
					case <-stopReading:
						return
					}
				case <-stopReading:
					return
				}
			}
		})
	}
	deadline := time.After(2 * time.Minute)
	for total := 0; total < messages*copies; {
		select {
		case l := <-lines:
			action, id, _ := strings.Cut(l, " ")
			switch action {
			case "ACK":
				acks[id]++
				total++
			case "NACK":
				nacks++ // requeued: it comes again
			case "REJECT":
				rejects++
				total++
			}
		case <-deadline:
			close(stopReading)
			readers.Wait()
			t.Fatalf("%d deliveries settled of %d within 2 minutes", total, messages*copies)
		}
	}
	close(stopReading)
	readers.Wait()
	for _, p := range procs {
		p.stop(t)
	}
	assert.Zero(t, rejects)
	assert.Len(t, acks, messages)
	for id, n := range acks {
		if n != copies {
			t.Errorf("message %s acked %d times, want %d", id, n, copies)
		}
	}
	assert.Equal(t, messages, count(t, w.ledger, ""))
	var distinct int
	require.NoError(t, db.QueryRow(`SELECT count(DISTINCT msg) FROM `+w.ledger).Scan(&distinct))
	assert.Equal(t, messages, distinct, "every message's row exactly once")
	assert.Equal(t, messages, count(t, w.runs, ""), "one run per message")
	t.Logf("%d deliveries acked, %d requeued on the way", messages*copies, nacks)

	// The broker's own counters (rabbitmqctl): nothing ready, nothing
	// delivered and unacked, nothing dead-lettered.
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "--no-table-headers",
		"name", "messages_ready", "messages_unacknowledged").CombinedOutput()
	require.NoError(t, err, string(out))
	seen := 0
	for l := range strings.SplitSeq(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 && (f[0] == w.queue || f[0] == w.dlq) {
			seen++
			assert.Equal(t, []string{f[0], "0", "0"}, f, "ready and unacked")
		}
	}
	assert.Equal(t, 2, seen, "rabbitmqctl lists both queues:\n%s", out)
}
