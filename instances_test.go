package idem_test

import (
	"bufio"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// receiver is one process of internal/testreceiver.
type receiver struct {
	url    string
	cmd    *exec.Cmd
	stderr *logBuffer // logging_test.go
}

// buildReceiver compiles internal/testreceiver into a temporary directory.
func buildReceiver(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "testreceiver")
	out, err := exec.Command("go", "build", "-o", bin, "./internal/testreceiver").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// startReceivers starts n instances on free loopback ports, all at once
// (so their Migrate calls race, as in a rolling deploy), and returns when
// every one listens. They are stopped (SIGTERM, then SIGKILL if one
// lingers) and waited for when t ends.
func startReceivers(t *testing.T, bin string, n int, args ...string) []*receiver {
	t.Helper()
	recv := make([]*receiver, n)
	lines := make([]*bufio.Reader, n)
	for i := range recv {
		r, stdout, exited := launch(t, bin, args...)
		t.Cleanup(func() {
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(15 * time.Second):
				_ = r.cmd.Process.Kill()
				<-exited
			}
			assert.True(t, r.cmd.ProcessState.Success(), "instance %s did not shut down cleanly: %s\n%s", r.url, r.cmd.ProcessState, r.stderr)
		})
		recv[i], lines[i] = r, stdout
	}
	for i, r := range recv {
		// The first line is the bound address; EOF first means it died.
		line, err := lines[i].ReadString('\n')
		require.NoError(t, err, "instance %d did not start: %s", i, r.stderr)
		r.url = "http://" + strings.TrimSpace(line)
	}
	return recv
}

// launch starts one receiver process on a free loopback port; exited is
// closed when it has exited. The caller reads its address from stdout.
func launch(t *testing.T, bin string, args ...string) (r *receiver, stdout *bufio.Reader, exited <-chan struct{}) {
	t.Helper()
	r = &receiver{cmd: exec.Command(bin, append([]string{"-addr", "127.0.0.1:0"}, args...)...), stderr: &logBuffer{}}
	r.cmd.Stderr = r.stderr
	out, err := r.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, r.cmd.Start())
	done := make(chan struct{})
	go func() {
		_ = r.cmd.Wait()
		close(done)
	}()
	return r, bufio.NewReader(out), done
}

// TestInstancesShareOneDatabaseExactlyOnce starts three processes of one
// receiver on one database and sends a retry storm spread across them:
// every event is delivered to every instance, twice, all at once, and
// deliveries answered 409 (in flight elsewhere) or 503 are retried as a
// sender would. Each event has exactly one side effect and every 2xx answer
// of an event has the same bytes, whichever instance sent it.
func TestInstancesShareOneDatabaseExactlyOnce(t *testing.T) {
	t.Parallel()
	const instances, events, perInstance = 3, 40, 2
	bin := buildReceiver(t)
	f := newFixture(t, idem.Options{}, nil) // the tables, and f.db for the checks
	recv := startReceivers(t, bin, instances, "-database-url", idem.TestDatabaseURL(t), "-table", f.table, "-ledger", f.ledger)

	s := newSender(t)
	var got replies
	ids := make([]string, events)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for e := range ids {
		ids[e] = fmt.Sprintf("evt_%d", e)
		for d := 0; d < instances*perInstance; d++ {
			wg.Add(1)
			go func(id string, target *receiver) {
				defer wg.Done()
				<-start
				for try := 0; try < 20; try++ {
					r, err := s.post(target.url, id, `{"event": "`+id+`"}`)
					if !assert.NoError(t, err) {
						return
					}
					got.add(id, r)
					if r.status != http.StatusConflict && r.status != http.StatusServiceUnavailable {
						return
					}
				}
			}(ids[e], recv[(e+d)%instances])
		}
	}
	close(start)
	wg.Wait()

	checkExactlyOnce(t, f, ids, &got)
	statuses := map[int]int{}
	for _, id := range ids {
		replayed := 0
		for _, r := range got.m[id] {
			statuses[r.status]++
			if r.status == http.StatusCreated {
				assert.Equal(t, "application/json", r.header.Get("Content-Type"))
				if r.header.Get("Idempotent-Replayed") == "true" {
					replayed++
				}
			}
		}
		assert.Equal(t, instances*perInstance-1, replayed, "%s: one original, every other delivery a replay", id)
	}
	t.Logf("answers by status: %v", statuses)
	for st := range statuses {
		assert.Contains(t, []int{http.StatusCreated, http.StatusConflict, http.StatusServiceUnavailable}, st)
	}
	if t.Failed() {
		for _, r := range recv {
			t.Logf("instance %s stderr:\n%s", r.url, r.stderr)
		}
	}
}
