package idem_test

import (
	"bufio"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// leaseReceivers starts two testreceiver processes in lease mode on f's
// tables, and returns them with the first one's standard output, past the
// address line. They are killed (if they still run) when t ends.
func leaseReceivers(t *testing.T, f *fixture, lease time.Duration) (first, second *receiver, out *bufio.Reader) {
	t.Helper()
	bin := buildReceiver(t)
	start := func() (*receiver, *bufio.Reader) {
		r, out, exited := launch(t, bin, "-database-url", idem.TestDatabaseURL(t),
			"-table", f.table, "-ledger", f.ledger, "-lease", lease.String(), "-lock-wait", "-1ns")
		t.Cleanup(func() {
			_ = r.cmd.Process.Signal(syscall.SIGCONT)
			_ = r.cmd.Process.Kill()
			<-exited
			if t.Failed() {
				t.Logf("receiver %s stderr:\n%s", r.url, r.stderr)
			}
		})
		line, err := out.ReadString('\n')
		require.NoError(t, err, "the receiver did not start: %s", r.stderr)
		r.url = "http://" + strings.TrimSpace(line)
		return r, out
	}
	first, out = start()
	second, _ = start()
	return first, second, out
}

// holdOn sends a delivery that the receiver holds (X-Hold) after writing
// its ledger row, and returns once the receiver says it holds it; the reply
// (or the error, if the receiver dies) arrives on the channel.
func holdOn(t *testing.T, r *receiver, out *bufio.Reader, id string) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, r.url, strings.NewReader(`{"event":"`+id+`"}`))
		if err != nil {
			done <- err
			return
		}
		req.Header.Set("X-Event-Id", id)
		req.Header.Set("X-Hold", "1")
		res, err := http.DefaultClient.Do(req)
		if err == nil {
			res.Body.Close()
			if res.StatusCode/100 == 2 {
				err = &statusError{res.StatusCode}
			}
		}
		done <- err
	}()
	line, err := out.ReadString('\n')
	require.NoError(t, err, "the receiver did not hold the delivery: %s", r.stderr)
	require.Equal(t, "held "+id, strings.TrimSpace(line))
	return done
}

// statusError is a 2xx where none may be.
type statusError struct{ status int }

func (e *statusError) Error() string {
	return http.StatusText(e.status) + " answered to a late original"
}

// waitLeaseOver polls until the key's lease has run out in the database's
// clock (bounded): the lease is time, and nothing else signals its end.
func waitLeaseOver(t *testing.T, f *fixture, id string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		inProgress, live := f.leaseRow("test", id)
		require.True(t, inProgress, "the key is no longer in progress")
		if !live {
			return
		}
		require.True(t, time.Now().Before(deadline), "the lease did not run out within %v", within)
		time.Sleep(50 * time.Millisecond)
	}
}

// A receiver process killed in the middle of a handler: its key is not run
// again while the lease lasts, and the first delivery after the lease runs
// out takes it over and runs it once; the killed run's write is gone.
func TestLeaseAfterACrash(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	const lease = 2 * time.Second
	crashing, survivor, out := leaseReceivers(t, f, lease)
	held := holdOn(t, crashing, out, "evt_crash")
	require.NoError(t, crashing.cmd.Process.Kill())
	assert.Error(t, <-held, "the killed receiver never answered")

	s := newSender(t)
	early, err := s.post(survivor.url, "evt_crash", `{"event":"evt_crash"}`)
	require.NoError(t, err)
	assert.Equal(t, http.StatusConflict, early.status, "not run again while the lease lasts: %s", early.body)
	assert.Equal(t, 0, f.ledgerRows(), "the killed run's write rolled back")

	waitLeaseOver(t, f, "evt_crash", 2*lease)
	after, err := s.post(survivor.url, "evt_crash", `{"event":"evt_crash"}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, after.status, "taken over: %s", after.body)
	replay, err := s.post(survivor.url, "evt_crash", `{"event":"evt_crash"}`)
	require.NoError(t, err)
	assert.Equal(t, after.body, replay.body)
	assert.Equal(t, 1, f.ledgerRows())
}

// A receiver process frozen (SIGSTOP) past its lease, as in a long GC or VM
// pause: another receiver takes the key over and stores its answer; the
// frozen one, continued, cannot store its own or commit its write, and its
// client gets no 2xx.
func TestLeaseFrozenOriginal(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	const lease = 2 * time.Second
	frozen, other, out := leaseReceivers(t, f, lease)
	held := holdOn(t, frozen, out, "evt_zombie")
	require.NoError(t, frozen.cmd.Process.Signal(syscall.SIGSTOP))

	waitLeaseOver(t, f, "evt_zombie", 2*lease)
	s := newSender(t)
	won, err := s.post(other.url, "evt_zombie", `{"event":"evt_zombie"}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, won.status, "taken over: %s", won.body)

	require.NoError(t, frozen.cmd.Process.Signal(syscall.SIGCONT))
	assert.NoError(t, <-held, "the frozen original's client gets no 2xx")
	replay, err := s.post(other.url, "evt_zombie", `{"event":"evt_zombie"}`)
	require.NoError(t, err)
	assert.Equal(t, won.body, replay.body, "the takeover's answer stays stored")
	assert.Equal(t, 1, f.ledgerRows(), "only the takeover's write committed")
}
