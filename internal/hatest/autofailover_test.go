//go:build hatest

package hatest

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ledger is the handlers' table: one row per run of the handler, no unique
// constraint, so an event processed twice shows as two rows.
const ledger = `CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, receiver text NOT NULL)`

// TestAutoFailoverLosesAndDoublesNothing runs idem on both adapters in
// front of a pg_auto_failover formation (a monitor, two nodes, synchronous
// replication), all on one multi-host URL. Senders deliver every event
// three times, at once, spread over the receivers, without pause. Mid-storm
// the formation is switched over, then its primary is killed (pg_autoctl
// and PostgreSQL, at once): the other node is promoted and runs in
// wait_primary, without a synchronous standby, where idem check
// -require-synchronous must exit 2 (it exits 0 on the healthy pair) and
// idemops.ReadDurability report Synchronous false. Then every event is
// redelivered until answered 2xx and the ledger counted: no event answered
// 2xx is lost, none ran twice, and every answer to an event is the same.
func TestAutoFailoverLosesAndDoublesNothing(t *testing.T) {
	start := time.Now()
	built := make(chan string, 1)
	go func() { built <- buildCLI(t) }() // meanwhile
	f := newFormation(t)
	t.Logf("formation up in %v", time.Since(start).Round(time.Second))
	url := f.url("postgres")
	ctx := context.Background()

	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	defer db.Close()
	require.NoError(t, idem.Migrate(ctx, db, ""))
	_, err = db.Exec(ledger)
	require.NoError(t, err)
	cli := <-built
	require.NotEmpty(t, cli, "the idem command did not build")

	// The healthy pair: commits wait for the secondary.
	f.await("the secondary to confirm commits", func() (bool, error) {
		d, err := idemops.ReadDurability(ctx, db)
		return err == nil && d.Synchronous(), nil
	})
	code, out := check(t, cli, url)
	require.Equal(t, 0, code, "idem check -require-synchronous on the synchronous pair: %s", out)

	recv := newReceivers(t, url)
	s := newStorm(recv)
	s.start(6)
	s.awaitAcks(t, 100)

	f.switchover()
	t.Logf("switched over at %d events answered 2xx; %v in", s.acked.Load(), time.Since(start).Round(time.Second))
	s.awaitAcks(t, s.acked.Load()+100)

	old := f.primary()
	survivor := f.other(old)
	ackedBeforeKill := s.acked.Load()
	f.kill(old)
	killed := time.Now()
	f.awaitStates(map[string]string{survivor.name: "wait_primary"})
	t.Logf("%s killed at %d events answered 2xx; %s in wait_primary after %v", old.name, ackedBeforeKill, survivor.name, time.Since(killed).Round(time.Millisecond))

	// wait_primary: no synchronous standby, and idem still answers 2xx.
	d, err := idemops.ReadDurability(ctx, db)
	require.NoError(t, err)
	assert.False(t, d.Synchronous(), "in wait_primary: %+v", d)
	assert.Empty(t, d.SynchronousStandbyNames)
	code, out = check(t, cli, url)
	assert.Equal(t, 2, code, "idem check -require-synchronous in wait_primary: %s", out)
	var doc struct {
		Durability struct {
			Synchronous, Required bool
		}
		Findings []struct{ Check string }
	}
	require.NoError(t, json.Unmarshal(out, &doc), "%s", out)
	assert.True(t, doc.Durability.Required)
	assert.False(t, doc.Durability.Synchronous)
	var checks []string // a claim mid-storm may show as claims_not_visible
	for _, f := range doc.Findings {
		checks = append(checks, f.Check)
	}
	assert.Contains(t, checks, "not_synchronous", "%s", out)
	s.awaitAcks(t, s.acked.Load()+100)
	s.stop()
	t.Logf("storm: %d events, %d deliveries, %d answered 2xx, %d answered otherwise (%v); %v in",
		s.events.Load(), s.deliveries.Load(), s.acked.Load(), s.failed.Load(), s.statuses(), time.Since(start).Round(time.Second))

	// Every event is redelivered until answered 2xx, as senders do.
	s.redeliverAll(t)
	t.Logf("redelivered every event; %v in", time.Since(start).Round(time.Second))

	// The ledger on the current primary.
	ran := map[string][]int64{}
	rows, err := db.Query(`SELECT event_id, id FROM ledger`)
	require.NoError(t, err)
	for rows.Next() {
		var e string
		var id int64
		require.NoError(t, rows.Scan(&e, &id))
		ran[e] = append(ran[e], id)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	lost, doubled, differing := 0, 0, 0
	for e, a := range s.answers() {
		switch ids := ran[e]; {
		case len(ids) > 1:
			doubled++
		case a.firstAck != 0 && (len(ids) == 0 || ids[0] != a.firstAck):
			lost++ // answered 2xx, then gone or run again with another id
		}
		if a.differ {
			differing++
		}
	}
	t.Logf("%d events: %d answered 2xx lost, %d processed twice, %d answered differently; %d ledger rows; %v in all",
		s.events.Load(), lost, doubled, differing, len(ran), time.Since(start).Round(time.Second))
	assert.Zero(t, lost, "events answered 2xx lost by the failovers")
	assert.Zero(t, doubled, "events processed twice")
	assert.Zero(t, differing, "events answered 2xx with different answers")
	assert.Equal(t, int(s.events.Load()), len(ran), "every event processed")
}

// buildCLI builds the idem command and returns its path, or "" (the test
// has failed then).
func buildCLI(t *testing.T) string {
	bin := filepath.Join(t.TempDir(), "idem")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/pgidem/idem/cmd/idem").CombinedOutput()
	if err != nil {
		t.Errorf("go build: %v: %s", err, out)
		return ""
	}
	return bin
}

// check runs idem check -require-synchronous -json on url and returns its
// exit code and report.
func check(t *testing.T, cli, url string) (int, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, cli, "check", "-require-synchronous", "-json", "-database-url", url)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatalf("idem check: %v", err)
	}
	require.Empty(t, stderr.String(), "a multi-host URL with connect_timeout: no warning")
	return cmd.ProcessState.ExitCode(), stdout.Bytes()
}

// receivers are idem on idempgx and on database/sql, each with a pool of 8
// on the multi-host URL, behind HTTP servers.
type receivers struct{ urls []string }

func newReceivers(t *testing.T, url string) *receivers {
	t.Helper()
	// The 503s of the failovers are counted by the storm, not logged.
	opts := idem.Options{KeyFunc: idem.Header("hatest", "X-Event-Id"), HandlerTimeout: 10 * time.Second,
		Logger: slog.New(slog.DiscardHandler)}
	r := &receivers{}

	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	pgxMW, err := idempgx.New(pool, opts)
	require.NoError(t, err)
	r.serve(t, pgxMW, "pgx", func(ctx context.Context, q string, args ...any) (int64, error) {
		tx, _ := idempgx.Tx(ctx)
		var id int64
		err := tx.QueryRow(ctx, q, args...).Scan(&id)
		return id, err
	})

	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	db.SetMaxOpenConns(8)
	t.Cleanup(func() { _ = db.Close() })
	sqlMW, err := idem.New(db, opts)
	require.NoError(t, err)
	r.serve(t, sqlMW, "database/sql", func(ctx context.Context, q string, args ...any) (int64, error) {
		tx, _ := idem.Tx(ctx)
		var id int64
		err := tx.QueryRowContext(ctx, q, args...).Scan(&id)
		return id, err
	})
	return r
}

// serve runs the ledger handler behind mw: it appends the event to the
// ledger in the request's transaction and answers the row's id.
func (r *receivers) serve(t *testing.T, mw *idem.Middleware, name string, insert func(ctx context.Context, q string, args ...any) (int64, error)) {
	srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		key, _ := idem.KeyFromContext(req.Context())
		id, err := insert(req.Context(), `INSERT INTO ledger (event_id, receiver) VALUES ($1, $2) RETURNING id`, key.EventID, name)
		if err != nil {
			http.Error(w, "ledger write failed", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, id)
	})))
	t.Cleanup(srv.Close)
	r.urls = append(r.urls, srv.URL)
}

// storm sends new events, each delivered three times at once, from a few
// senders, until stopped.
type storm struct {
	recv                              *receivers
	client                            *http.Client
	events, deliveries, acked, failed atomic.Int64
	ackedCh                           chan struct{} // a tick per 2xx, never blocking
	done                              chan struct{}
	wg                                sync.WaitGroup
	mu                                sync.Mutex
	byEvent                           map[string]*answer
	byStatus                          map[int]int
}

// answer is what the senders were answered for one event.
type answer struct {
	firstAck int64 // the ledger id of the first 2xx answer, 0 before one
	differ   bool  // a 2xx answer had another id
}

func newStorm(r *receivers) *storm {
	return &storm{recv: r, client: &http.Client{Timeout: 30 * time.Second}, ackedCh: make(chan struct{}, 1),
		done: make(chan struct{}), byEvent: map[string]*answer{}, byStatus: map[int]int{}}
}

func (s *storm) start(senders int) {
	for i := range senders {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			for {
				select {
				case <-s.done:
					return
				default:
				}
				e := "evt_" + strconv.FormatInt(s.events.Add(1), 10)
				s.mu.Lock()
				s.byEvent[e] = &answer{}
				s.mu.Unlock()
				var wg sync.WaitGroup
				for d := range 3 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						s.deliver(e, s.recv.urls[(i+d)%len(s.recv.urls)])
					}()
				}
				wg.Wait()
			}
		}()
	}
}

// deliver sends one delivery of event e and records its answer; it
// reports whether it was 2xx.
func (s *storm) deliver(e, url string) bool {
	s.deliveries.Add(1)
	req, _ := http.NewRequest(http.MethodPost, url+"/hook", bytes.NewBufferString(`{"event":"`+e+`"}`))
	req.Header.Set("X-Event-Id", e)
	status, id := 0, int64(0)
	res, err := s.client.Do(req)
	if err == nil {
		body, _ := io.ReadAll(res.Body)
		_ = res.Body.Close()
		status = res.StatusCode
		id, _ = strconv.ParseInt(string(body), 10, 64)
	}
	s.mu.Lock()
	s.byStatus[status]++
	a := s.byEvent[e]
	ok := status >= 200 && status < 300
	switch {
	case ok && a.firstAck == 0:
		a.firstAck = id
	case ok && a.firstAck != id:
		a.differ = true
	}
	s.mu.Unlock()
	if !ok {
		s.failed.Add(1)
		return false
	}
	s.acked.Add(1)
	select {
	case s.ackedCh <- struct{}{}:
	default:
	}
	return true
}

// awaitAcks waits until n deliveries have been answered 2xx in all.
func (s *storm) awaitAcks(t *testing.T, n int64) {
	t.Helper()
	deadline := time.After(stateBound)
	for s.acked.Load() < n {
		select {
		case <-s.ackedCh:
		case <-deadline:
			t.Fatalf("gave up waiting for %d answers 2xx (%d so far; %v)", n, s.acked.Load(), s.statuses())
		}
	}
}

func (s *storm) stop() {
	close(s.done)
	s.wg.Wait()
}

// statuses counts the answers by status (0: no answer).
func (s *storm) statuses() map[int]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[int]int{}
	for k, v := range s.byStatus {
		out[k] = v
	}
	return out
}

func (s *storm) answers() map[string]answer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]answer, len(s.byEvent))
	for e, a := range s.byEvent {
		out[e] = *a
	}
	return out
}

// redeliverAll delivers every event once more until it is answered 2xx
// (at most 20 tries each; a 409 means its original is still committing).
func (s *storm) redeliverAll(t *testing.T) {
	t.Helper()
	events := s.answers()
	var wg sync.WaitGroup
	todo := make(chan string)
	var stuck atomic.Int64
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for e := range todo {
				ok := false
				for try := 0; try < 20 && !ok; try++ {
					ok = s.deliver(e, s.recv.urls[(i+try)%len(s.recv.urls)])
					if !ok {
						time.Sleep(100 * time.Millisecond) // a sender's back-off
					}
				}
				if !ok {
					stuck.Add(1)
				}
			}
		}()
	}
	for e := range events {
		todo <- e
	}
	close(todo)
	wg.Wait()
	require.Zero(t, stuck.Load(), "events never answered 2xx: %v", s.statuses())
}
