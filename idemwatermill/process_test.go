package idemwatermill_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// helperEnv, set, makes the test binary a consumer process (consumerMain)
// instead of running the tests; its value is the consumer's settings,
// written by consumerSettings.
const helperEnv = "IDEMWATERMILL_CONSUMER"

// consumer is a consumer process's settings.
type consumer struct {
	db, adapter string
	ns          names
	crash       string        // "", "before-commit", "after-commit"
	lease       time.Duration // 0: single-transaction mode
	quorum      bool          // ns.in is a quorum queue with a delivery limit
	handlers    int           // handlers competing for ns.in (newRouter)
	paused      bool          // ready, it says so on stdout and waits for a line on stdin to run
}

func (c consumer) encode() string {
	return strings.Join([]string{c.db, c.adapter, c.ns.table, c.ns.ledger, c.ns.runs, c.ns.in, c.ns.out, c.ns.poison, c.ns.dead,
		c.crash, c.lease.String(), strconv.FormatBool(c.quorum), strconv.Itoa(c.handlers), strconv.FormatBool(c.paused)}, "|")
}

func decodeConsumer(s string) (consumer, error) {
	f := strings.Split(s, "|")
	if len(f) != 14 {
		return consumer{}, fmt.Errorf("%s: %d fields", helperEnv, len(f))
	}
	lease, err := time.ParseDuration(f[10])
	if err != nil {
		return consumer{}, err
	}
	handlers, err := strconv.Atoi(f[12])
	if err != nil {
		return consumer{}, err
	}
	return consumer{db: f[0], adapter: f[1], ns: names{table: f[2], ledger: f[3], runs: f[4], in: f[5], out: f[6], poison: f[7], dead: f[8]},
		crash: f[9], lease: lease, quorum: f[11] == "true", handlers: handlers, paused: f[13] == "true"}, nil
}

// consumerMain is a consumer process: a watermill Router with idem's
// middleware on the app's handler, until SIGTERM (or SIGKILL). Its log
// goes to stderr.
func consumerMain() int {
	c, err := decodeConsumer(os.Getenv(helperEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := runConsumer(c); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		return 1
	}
	return 0
}

func runConsumer(c consumer) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	d, err := sql.Open("pgx", c.db)
	if err != nil {
		return err
	}
	defer d.Close()
	var closers []func()
	defer func() {
		for _, f := range closers {
			f()
		}
	}()
	l := &logs{}
	l.onLine = func(line string) { fmt.Fprint(os.Stderr, line) }
	mw, err := newMiddleware(ctx, c.adapter, c.db, idem.Options{Table: c.ns.table, Lease: c.lease, Logger: l.logger()},
		func(f func()) { closers = append(closers, f) })
	if err != nil {
		return err
	}
	a := &app{db: d, ns: c.ns, crash: c.crash}
	r, rclosers, err := newRouter(a, mw, c.quorum, c.handlers, watermill.NewSlogLogger(l.logger()), idemwatermill.WithLogger(l.logger()))
	if err != nil {
		return err
	}
	defer func() {
		for _, f := range rclosers {
			_ = f()
		}
	}()
	if c.paused {
		fmt.Println("ready")
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			return err
		}
	}
	return r.Run(ctx)
}

// command is a consumer process with settings c, not yet started; its log
// goes to out (and to the test's log if the test fails). It is killed at
// the test's end if still running.
func command(t *testing.T, c consumer, out *logs) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+c.encode())
	cmd.Stderr = out
	t.Cleanup(func() {
		if cmd.Process == nil {
			return
		}
		if t.Failed() {
			t.Logf("consumer %d's log:\n%s", cmd.Process.Pid, out.String())
		}
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd
}

// start runs a consumer process.
func start(t *testing.T, c consumer, out *logs) *exec.Cmd {
	t.Helper()
	cmd := command(t, c, out)
	require.NoError(t, cmd.Start())
	return cmd
}

// startPaused starts a paused consumer process, waits until it is ready
// (connected, its router built), and returns it with the function that lets
// it run.
func startPaused(t *testing.T, c consumer, out *logs) (*exec.Cmd, func()) {
	t.Helper()
	c.paused = true
	cmd := command(t, c, out)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err, "the consumer did not get ready:\n%s", out.String())
	require.Equal(t, "ready\n", line)
	return cmd, func() {
		_, err := io.WriteString(stdin, "go\n")
		require.NoError(t, err)
	}
}

// stop ends a consumer process as an operator would (SIGTERM: the router
// closes) and waits for it.
func stop(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait())
}

// waitKilled waits for a consumer process that kills itself.
func waitKilled(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	err := cmd.Wait()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "the consumer was to be killed, it ended with %v", err)
	ws, ok := ee.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "the consumer ended with %v, not SIGKILL", err)
}

// A consumer process killed by SIGKILL mid-handler (after its writes,
// before COMMIT) or after the COMMIT (before the router publishes the
// produced message and acks): the message is redelivered to another
// consumer process, its ledger row exists once, and the produced message is
// published once; after the COMMIT, the redelivery is a replay: the handler
// does not run again, and the message published is the one the killed run
// produced, with its UUID.
func TestCrashedConsumer(t *testing.T) {
	t.Parallel()
	for _, crash := range []string{"before-commit", "after-commit"} {
		t.Run(crash, func(t *testing.T) {
			t.Parallel()
			forAdapters(t, func(t *testing.T, adapter string) {
				ns := newNames(t, false)
				outs := watch(t, ns.out)
				c := consumer{db: dbURL, adapter: adapter, ns: ns, crash: crash}
				var log1, log2 logs
				first := start(t, c, &log1)
				publish(t, ns.in, "order-1", "order 1")
				waitKilled(t, first)
				require.Equal(t, 1, count(t, ns.runs, ""), "the killed consumer ran the handler")

				c.crash = ""
				second := start(t, c, &log2)
				out := outs.next("output")
				stop(t, second)

				assert.Equal(t, 1, count(t, ns.ledger, "event_id = 'order-1'"), "ledger rows")
				var produced []string
				rows, err := db.Query(`SELECT produced FROM `+ns.runs+` ORDER BY pid = $1 DESC`, first.Process.Pid)
				require.NoError(t, err)
				for rows.Next() {
					var p string
					require.NoError(t, rows.Scan(&p))
					produced = append(produced, p)
				}
				require.NoError(t, rows.Err())
				if crash == "after-commit" {
					require.Len(t, produced, 1, "the redelivery was a replay, not a second run")
					assert.Equal(t, produced[0], out.uuid, "the replay published the message the killed run produced")
				} else {
					require.Len(t, produced, 2, "the redelivery ran the handler again")
					assert.Equal(t, produced[1], out.uuid, "the message published is the second run's")
				}
				assert.Equal(t, "done:order 1", out.body)
				assert.Equal(t, "order-1", out.headers["event"])
				assert.Equal(t, 0, queued(t, ns.in), "nothing left on the input queue")
				assert.Empty(t, outs.rest(), "the produced message was published once")
				assert.Equal(t, 0, queued(t, ns.out))
				assert.Equal(t, 0, queued(t, ns.poison))
			})
		})
	}
}

// A duplicate whose original is in flight does not spend the redelivery
// budget. The input is a quorum queue that dead-letters a message returned
// more than once (x-delivery-limit 1). A lease-mode consumer is killed
// mid-handler, its lease still running; its message comes back (once
// returned) and a duplicate is published. Another consumer, started and
// paused beforehand so that it runs while the lease does, holds each
// (idem.ErrInFlight: for the lease's time left) instead of nacking it, takes
// the key over once the lease ends, and replays the other: nothing is
// dead-lettered, the ledger row exists once.
func TestInFlightHeldNotNacked(t *testing.T) {
	t.Parallel()
	forAdapters(t, func(t *testing.T, adapter string) {
		ns := newNames(t, true)
		outs := watch(t, ns.out)
		c := consumer{db: dbURL, adapter: adapter, ns: ns, lease: 5 * time.Second, quorum: true}
		var log1, log2 logs
		second, run := startPaused(t, c, &log2) // ready before the lease starts
		c.crash = "before-commit"
		first := start(t, c, &log1)
		publish(t, ns.in, "order-1", "order 1")
		waitKilled(t, first)
		publish(t, ns.in, "order-1", "order 1")
		run()
		a, b := outs.next("output"), outs.next("output")
		stop(t, second)

		assert.True(t, log2.has("holding the message"), "the second consumer held a message:\n%s", log2.String())
		assert.Equal(t, 1, count(t, ns.ledger, ""), "ledger rows")
		assert.Equal(t, 2, count(t, ns.runs, ""), "the killed run and the takeover")
		assert.Equal(t, a.uuid, b.uuid, "the duplicate replayed the takeover's message")
		assert.Equal(t, 0, queued(t, ns.dead), "nothing dead-lettered")
		assert.Empty(t, outs.rest())
		assert.Equal(t, 0, queued(t, ns.in))
		assert.Equal(t, 0, queued(t, ns.poison))
	})
}

// The storm: 1,000 messages, each published 3 times (two copies one after
// the other, the third after all the others), to 3 consumer processes, each
// with 3 handlers competing for the queue (sharing their keys: WithSource).
// The processes use both adapters on the one table (database/sql, pgx,
// database/sql): the adapters claim keys alike, and each meets the other's
// claims.
// Every message's ledger row exists once, its handler ran once, every
// delivery was acked after publishing the message its key produced (the
// same UUID three times), and nothing is left on the queues.
func TestStorm(t *testing.T) {
	t.Parallel()
	const messages, copies, consumers = 1000, 3, 3
	ns := newNames(t, false)
	outs := watch(t, ns.out)
	var outLogs [consumers]logs
	var started []*exec.Cmd
	for i := range consumers {
		c := consumer{db: dbURL, adapter: adapters[i%len(adapters)], ns: ns, handlers: 3}
		started = append(started, start(t, c, &outLogs[i]))
	}
	ch, err := broker.Channel()
	require.NoError(t, err)
	for i := range messages {
		id := fmt.Sprintf("storm-%d", i)
		publishOn(t, ch, ns.in, id, "storm "+id)
		publishOn(t, ch, ns.in, id, "storm "+id)
	}
	for i := range messages {
		id := fmt.Sprintf("storm-%d", i)
		publishOn(t, ch, ns.in, id, "storm "+id)
	}
	require.NoError(t, ch.Close())

	byEvent := map[string]map[string]int{}
	for range messages * copies {
		d := outs.next("output")
		ev, _ := d.headers["event"].(string)
		if byEvent[ev] == nil {
			byEvent[ev] = map[string]int{}
		}
		byEvent[ev][d.uuid]++
	}
	for _, cmd := range started {
		stop(t, cmd)
	}

	assert.Len(t, byEvent, messages)
	for ev, uuids := range byEvent {
		assert.Len(t, uuids, 1, "event %s published under one UUID", ev)
	}
	assert.Equal(t, messages, count(t, ns.ledger, ""), "ledger rows")
	var dup int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM (SELECT event_id FROM `+ns.ledger+` GROUP BY 1 HAVING count(*) > 1) d`).Scan(&dup))
	assert.Zero(t, dup, "events with more than one ledger row")
	assert.Equal(t, messages, count(t, ns.runs, ""), "handler runs")
	assert.Equal(t, 0, queued(t, ns.in), "nothing left unacked or unread on the input queue")
	assert.Empty(t, outs.rest(), "no produced message beyond one per delivery")
	assert.Equal(t, 0, queued(t, ns.out))
	assert.Equal(t, 0, queued(t, ns.poison), "nothing poisoned")
}
