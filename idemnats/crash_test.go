package idemnats_test

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The crash tests run consumers as processes of their own (this test
// binary again, with helperEnv set) and kill them with SIGKILL.

// helperEnv carries a consumer process's config (helperConfig, as JSON).
const helperEnv = "IDEMNATS_TEST_CONSUMER"

// helperConfig is what a consumer process needs.
type helperConfig struct {
	DB, NATS, Adapter, Table, Ledger, Runs, Stream, Durable string
	Lease                                                   time.Duration
	// Mode: "" (handle every message), "crash-in-fn" (SIGKILL itself in
	// the handler, after its write, before COMMIT), "crash-on-ack"
	// (SIGKILL itself after COMMIT, when it acks), "block-in-fn" (print
	// "inside <event id>" after the write, and wait to be killed).
	Mode string
}

// helperMain is a consumer process: it prints "done <event id>
// <delivery count> ok|err=..." after each message, until it is killed or
// its standard input closes (the test is gone).
func helperMain() int {
	var cfg helperConfig
	if err := json.Unmarshal([]byte(os.Getenv(helperEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "consumer:", err); return 1 }
	sdb, err := sql.Open("pgx", cfg.DB)
	if err != nil {
		return fail(err)
	}
	opts := idem.Options{Table: cfg.Table, Lease: cfg.Lease, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	var mw *idem.Middleware
	if cfg.Adapter == "pgx" {
		pool, err := pgxpool.New(ctx, cfg.DB)
		if err != nil {
			return fail(err)
		}
		mw, err = idempgx.New(pool, opts)
		if err != nil {
			return fail(err)
		}
	} else if mw, err = idem.New(sdb, opts); err != nil {
		return fail(err)
	}
	conn, err := nats.Connect(cfg.NATS)
	if err != nil {
		return fail(err)
	}
	jsc, err := jetstream.New(conn)
	if err != nil {
		return fail(err)
	}
	cons, err := jsc.Consumer(ctx, cfg.Stream, cfg.Durable)
	if err != nil {
		return fail(err)
	}
	kill := func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) }
	handle := func(ctx context.Context, msg jetstream.Msg) error {
		key, _ := idem.KeyFromContext(ctx)
		if _, err := sdb.ExecContext(ctx, `INSERT INTO `+cfg.Runs+` (event) VALUES ($1)`, key.EventID); err != nil {
			return err
		}
		if err := ledgerWrite(ctx, cfg.Ledger, key.EventID, msg.Data()); err != nil {
			return err
		}
		switch cfg.Mode {
		case "crash-in-fn":
			kill()
		case "block-in-fn":
			fmt.Println("inside", key.EventID)
			select {}
		}
		return nil
	}
	c, err := idemnats.New(mw, cons, handle, idemnats.WithLogger(opts.Logger))
	if err != nil {
		return fail(err)
	}
	handleOne := func(m jetstream.Msg) {
		msg := m
		if cfg.Mode == "crash-on-ack" {
			msg = &spy{Msg: m, drop: map[string]bool{"Ack": true}, onAck: kill}
		}
		err := c.HandleContext(ctx, msg)
		key, _ := c.Key(m)
		meta, _ := m.Metadata()
		outcome := "ok"
		if err != nil {
			outcome = "err=" + strings.ReplaceAll(err.Error(), "\n", " ")
		}
		fmt.Printf("done %s %d %s\n", key.EventID, meta.NumDelivered, outcome)
	}
	if cfg.Mode != "" {
		// One message, fetched alone: a process that is to die leaves
		// no pull request behind on the server, which would take a
		// redelivery meant for the next process.
		m, err := cons.Next(jetstream.FetchMaxWait(30 * time.Second))
		if err != nil {
			return fail(err)
		}
		handleOne(m)
		return 3 // not reached: the mode kills the process
	}
	cc, err := cons.Consume(handleOne, jetstream.PullMaxMessages(100)) // a killed one strands fewer

	if err != nil {
		return fail(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin) // until the test closes it, or is gone
	cc.Stop()
	conn.Close()
	return 0
}

// proc is a consumer process.
type proc struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // its standard output, line by line; closed at its end
	stderr *syncBuffer
	dones  atomic.Int64 // "done" lines read so far by waitFor
}

// start runs a consumer process on the world's stream and consumer
// durable, in mode (see helperConfig).
func (w *world) start(t *testing.T, durable, mode string) *proc {
	t.Helper()
	cfg, err := json.Marshal(helperConfig{DB: dbURL, NATS: natsURL, Adapter: w.adapter, Table: w.table, Ledger: w.ledger,
		Runs: w.runs, Stream: w.stream, Durable: durable, Lease: w.opts.Lease, Mode: mode})
	require.NoError(t, err)
	p := &proc{t: t, cmd: exec.Command(os.Args[0], "-test.run=^$"), lines: make(chan string, 1<<16), stderr: &syncBuffer{}}
	p.cmd.Env = append(os.Environ(), helperEnv+"="+string(cfg))
	p.cmd.Stderr = p.stderr
	out, err := p.cmd.StdoutPipe()
	require.NoError(t, err)
	p.stdin, err = p.cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	read := make(chan struct{})
	go func() {
		defer close(read)
		defer close(p.lines)
		s := bufio.NewScanner(out)
		for s.Scan() {
			p.lines <- s.Text()
		}
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-read
		_ = p.cmd.Wait()
		if t.Failed() {
			t.Logf("consumer %d (%s) stderr:\n%s", p.cmd.Process.Pid, mode, p.stderr.String())
		}
	})
	return p
}

// waitFor reads the process's output until a line starts with prefix, and
// returns it; it fails if the process ends first.
func (p *proc) waitFor(prefix string) string {
	p.t.Helper()
	timeout := time.After(45 * time.Second)
	for {
		select {
		case l, ok := <-p.lines:
			require.True(p.t, ok, "the consumer ended before printing %q; stderr:\n%s", prefix, p.stderr.String())
			if strings.HasPrefix(l, "done ") {
				p.dones.Add(1)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-timeout:
			p.t.Fatalf("no line %q from the consumer; stderr:\n%s", prefix, p.stderr.String())
		}
	}
}

// killed waits for the process to end, and checks that SIGKILL ended it.
func (p *proc) killed() {
	p.t.Helper()
	for range p.lines { // its output, until it ends
	}
	err := p.cmd.Wait()
	var exit *exec.ExitError
	require.ErrorAs(p.t, err, &exit, "stderr:\n%s", p.stderr.String())
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(p.t, ok)
	require.Equal(p.t, syscall.SIGKILL, ws.Signal(), "stderr:\n%s", p.stderr.String())
}

// eventually polls cond until it holds, for what has no event to wait on
// (the broker's counters after an ack).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute) // a storm beside the test command's other modules on 2 cores
	for !cond() {
		require.True(t, time.Now().Before(deadline), "never: %s", what)
		time.Sleep(20 * time.Millisecond)
	}
}

// settled reports whether the consumer has nothing pending or unacked.
func settled(t *testing.T, cons jetstream.Consumer) func() bool {
	return func() bool {
		ci := info(t, cons)
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}
}

// TestACrashedConsumerProcessLeavesOneLedgerRow: a consumer process killed
// (a) in its handler after its write, before COMMIT: another process runs
// the message again; (b) after COMMIT, before the ack: another process
// replays it, the handler does not run again. One ledger row either way.
func TestACrashedConsumerProcessLeavesOneLedgerRow(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, mode      string
		committed, runs int // ledger rows after the crash; runs of the handler in all
	}{
		{"mid-handler, before COMMIT: run again", "crash-in-fn", 0, 2},
		{"after COMMIT, before the ack: replayed", "crash-on-ack", 1, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			forAdapters(t, func(t *testing.T, adapter string) {
				w := newWorld(t, adapter, idem.Options{})
				cons := w.consumer(jetstream.ConsumerConfig{MaxDeliver: 5})
				w.publish("crash", []byte("x"))
				w.start(t, "worker", tc.mode).killed()
				assert.Equal(t, tc.committed, w.count(w.ledger, ""), "after the crash")

				line := w.start(t, "worker", "").waitFor("done crash")
				assert.Equal(t, "done crash 2 ok", line, "the redelivery, acked")
				assert.Equal(t, 1, w.count(w.ledger, "crash"), "one ledger row")
				assert.Equal(t, tc.runs, w.count(w.runs, ""), "the handler's runs")
				eventually(t, "the message acked", settled(t, cons))
			})
		})
	}
}

func TestAnInFlightOriginalDoesNotSpendTheDeliveryBudget(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		// The original takes the key under a 3s lease and dies; its
		// redelivery (the last MaxDeliver allows) meets the live lease,
		// is held with InProgress() until it runs out, and then runs.
		w := newWorld(t, adapter, idem.Options{Lease: 3 * time.Second})
		cons := w.consumer(jetstream.ConsumerConfig{MaxDeliver: 2, AckWait: time.Second})
		w.publish("held", []byte("x"))
		original := w.start(t, "worker", "block-in-fn")
		original.waitFor("inside held")
		require.NoError(t, original.cmd.Process.Signal(syscall.SIGKILL))
		original.killed()
		assert.Equal(t, 1, w.keys(), "the crashed original's lease holds the key")

		line := w.start(t, "worker", "").waitFor("done held")
		assert.Equal(t, "done held 2 ok", line, "the second and last delivery ran")
		assert.Equal(t, 1, w.count(w.ledger, "held"))
		assert.Equal(t, 2, w.count(w.runs, ""))
		eventually(t, "the message acked", settled(t, cons))
		assert.EqualValues(t, 1, info(t, cons).AckFloor.Stream)
	})
}

func TestStormEveryMessageOnceAcrossThreeConsumersAndACrash(t *testing.T) {
	t.Parallel()
	const messages, copies = 1000, 3
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, idem.Options{})
		cons := w.consumer(jetstream.ConsumerConfig{MaxDeliver: 10, AckWait: 2 * time.Second})
		procs := []*proc{w.start(t, "worker", ""), w.start(t, "worker", ""), w.start(t, "worker", "")}
		for round := range copies {
			futures := make([]jetstream.PubAckFuture, 0, messages)
			for i := range messages {
				m := nats.NewMsg(w.subject)
				m.Data = fmt.Appendf(nil, `{"n":%d}`, i)
				m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("storm-%d", i))
				f, err := js.PublishMsgAsync(m)
				require.NoError(t, err)
				futures = append(futures, f)
			}
			for i, f := range futures {
				select {
				case ack := <-f.Ok():
					if ack.Duplicate { // inside the duplicate window still: again
						w.publish(fmt.Sprintf("storm-%d", i), fmt.Appendf(nil, `{"n":%d}`, i))
					}
				case err := <-f.Err():
					require.NoError(t, err)
				}
			}
			if round == 0 {
				// One consumer dies by SIGKILL with work in hand; another
				// takes its place.
				for procs[0].dones.Load() < 50 {
					procs[0].waitFor("done ")
				}
				require.NoError(t, procs[0].cmd.Process.Signal(syscall.SIGKILL))
				procs[0].killed()
				procs[0] = w.start(t, "worker", "")
			}
			time.Sleep(150 * time.Millisecond) // past the stream's duplicate window (100ms): no event for it
		}
		eventually(t, "every delivery answered", settled(t, cons))
		ci := info(t, cons)
		assert.EqualValues(t, messages*copies, ci.AckFloor.Stream, "every stored message acked")
		var rows, distinct, twice int
		require.NoError(t, db.QueryRow(`SELECT count(*), count(DISTINCT event) FROM `+w.ledger).Scan(&rows, &distinct))
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM (SELECT event FROM `+w.ledger+` GROUP BY event HAVING count(*) > 1) d`).Scan(&twice))
		assert.Equal(t, messages, rows, "one ledger row per message")
		assert.Equal(t, messages, distinct)
		assert.Zero(t, twice)
		for _, p := range procs[1:] {
			assert.NotContains(t, p.stderr.String(), "terminated")
		}
	})
}
