package failover

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/internal/pgcluster"
	"github.com/stretchr/testify/require"
)

// With a synchronous standby, a failover in the middle of a retry storm
// loses no answered event and processes none twice: every event answered
// 2xx before the failover is on the promoted standby, and its redelivery
// gets the same answer.
func TestFailoverWithASynchronousStandbyLosesNoAnsweredEvent(t *testing.T) {
	r := failover(t, true)
	require.Zero(t, r.lost, "answered events lost by the failover: %v", r.lostEvents)
	require.Zero(t, r.reanswered, "answered events that answered differently after the failover")
}

// The negative control: the same storm and failover with asynchronous
// replication loses events that were answered 2xx (their redelivery runs
// the handler again, with another answer; a sender that got the 2xx never
// redelivers, so in production they are lost). The numbers are reported,
// and quoted in docs/durability.md. The test fails only if nothing was
// lost: then the pause of the WAL stream did not work and the synchronous
// run proves nothing.
func TestFailoverWithAsynchronousReplicationLosesAnsweredEvents(t *testing.T) {
	r := failover(t, false)
	require.Positive(t, r.lost, "the control lost nothing: the WAL stream was not held back")
	require.Equal(t, r.lost, r.reanswered, "every lost event runs again on redelivery, with another answer")
}

// failoverResult is what one failover run measured.
type failoverResult struct {
	events      int // distinct events
	deliveries  int // deliveries sent in the storm, before the failover
	answered    int // events answered 2xx in the storm
	afterPause  int // of which first answered after the WAL stream was held back
	unavailable int // storm deliveries answered 503
	lost        int // answered events missing from the promoted standby
	reanswered  int // answered events whose redelivery got another answer
	lostEvents  []string
	// lost events that a receiver's replay cache answered on redelivery,
	// as the old primary had (until ReplayCacheTTL); they run again on a
	// receiver restarted after the failover
	staleFromMemory int
	redeliveries    int // deliveries of the redelivery pass, retries included
}

func (r failoverResult) String() string {
	return fmt.Sprintf("%d events, %d storm deliveries across 4 receivers: %d events answered 2xx before the failover (%d of them after the WAL stream was held back), %d deliveries answered 503; after the failover %d answered events were missing from the promoted standby (%d of them answered on redelivery from a receiver's replay cache, as before the failover) and %d answered differently once redelivered to the new primary; redelivery pass: %d deliveries; every event processed exactly once in the end",
		r.events, r.deliveries, r.answered, r.afterPause, r.unavailable, r.lost, r.staleFromMemory, r.reanswered, r.redeliveries)
}

// failover runs the storm on a primary and a standby (synchronous or not):
// four receivers, one per way of reaching PostgreSQL, on a multi-host URL
// that goes to whichever of the two accepts writes; every event delivered
// three times by eight senders. Once a third of the events are answered,
// the standby's WAL stream is held back (the primary's walsender is stopped
// with SIGSTOP: pausing the standby's walreceiver instead would let what
// the kernel already buffered arrive later, and would hold up the
// promotion, which waits for the walreceiver to exit). Once more events
// were answered (asynchronous) or a COMMIT timed out waiting for the standby
// (synchronous), the primary is killed (pg_ctl stop -m immediate) while the
// storm goes on, and the standby is promoted. Then every event is
// redelivered until it is answered 2xx. It checks that every event was
// processed exactly once on the promoted standby and reports what was lost.
func failover(t *testing.T, synchronous bool) failoverResult {
	start := time.Now()
	s := clusters(t)
	mode := map[bool]string{true: "sync", false: "async"}[synchronous]
	primary, standby, _, walsender := newPair(t, s, mode, synchronous)

	report := check(t, primary)
	if synchronous {
		require.Equal(t, []string{standby.Name}, report.SyncStandbys)
		require.Contains(t, report.Summary, "survives a failover")
	} else {
		require.Empty(t, report.SyncStandbys)
		require.Equal(t, 1, report.OtherReplicas)
		require.Contains(t, report.Summary, "can be lost by a failover")
	}
	require.True(t, check(t, standby).InRecovery)

	url := pgcluster.MultiHostURL("postgres", primary, standby)
	opts := idem.Options{HandlerTimeout: time.Second, LockWait: 200 * time.Millisecond}
	var receivers []*receiver
	for i, via := range allVias {
		receivers = append(receivers, newReceiver(t, fmt.Sprintf("r%d", i), via, url, opts))
	}
	setup := time.Since(start)

	// The storm: each event three times, its deliveries close together.
	const events, copies, senders = 200, 3, 8
	var queue []string
	for i := range events {
		for range copies {
			queue = append(queue, fmt.Sprintf("ev%03d", i))
		}
	}
	for i := range queue {
		j := min(len(queue)-1, i+rand.IntN(12))
		queue[i], queue[j] = queue[j], queue[i]
	}
	type delivery struct {
		event string
		a     answer
		after bool // sent after the WAL stream was held back
	}
	var (
		mu          sync.Mutex
		log         []delivery
		answered    = map[string]bool{}
		paused      atomic.Bool
		unavailable atomic.Int32
		next        atomic.Int64
		stop        = make(chan struct{})
		wg          sync.WaitGroup
		progress    = make(chan struct{}, 1)
	)
	for w := range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := next.Add(1) - 1
				if i >= int64(len(queue)) {
					return
				}
				after := paused.Load()
				a := receivers[(int(i)+w)%len(receivers)].deliver(queue[i])
				mu.Lock()
				log = append(log, delivery{queue[i], a, after})
				if a.status/100 == 2 {
					answered[queue[i]] = true
				}
				mu.Unlock()
				if a.status == http.StatusServiceUnavailable && after {
					unavailable.Add(1)
				}
				select {
				case progress <- struct{}{}:
				default:
				}
			}
		}()
	}
	countAnswered := func() int { mu.Lock(); defer mu.Unlock(); return len(answered) }
	awaitStorm := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.After(20 * time.Second)
		for !cond() {
			select {
			case <-progress:
			case <-deadline:
				close(stop)
				wg.Wait()
				t.Fatalf("storm: %s did not happen within 20s", what)
			}
		}
	}
	awaitStorm("a third of the events answered", func() bool { return countAnswered() >= events/3 })
	require.NoError(t, primary.Pause(walsender))
	paused.Store(true)
	before := countAnswered()
	if synchronous {
		awaitStorm("a COMMIT timed out waiting for the standby", func() bool { return unavailable.Load() > 0 })
	} else {
		awaitStorm("20 more events answered", func() bool { return countAnswered() >= before+20 })
	}
	stormTime := time.Since(start) - setup

	// The crash, mid-storm; then the storm ends and the standby takes over.
	require.NoError(t, primary.Kill())
	close(stop)
	wg.Wait()
	require.NoError(t, standby.Promote())
	failoverTime := time.Since(start) - setup - stormTime

	// What was answered 2xx before the failover, and its answer: every 2xx
	// of one event must be the same answer (one run, then replays).
	var r failoverResult
	r.events = events
	r.deliveries = len(log)
	acked := map[string]string{}
	firstAfterPause := map[string]bool{}
	for _, d := range log {
		if d.a.status/100 != 2 {
			if d.a.status == http.StatusServiceUnavailable {
				r.unavailable++
			}
			require.Contains(t, []int{http.StatusConflict, http.StatusServiceUnavailable}, d.a.status, "storm answer for %s: %s", d.event, d.a.body)
			continue
		}
		if prev, ok := acked[d.event]; ok {
			require.Equal(t, prev, d.a.body, "event %s answered twice differently before the failover", d.event)
			continue
		}
		acked[d.event] = d.a.body
		firstAfterPause[d.event] = d.after
	}
	r.answered = len(acked)
	for e := range acked {
		if firstAfterPause[e] {
			r.afterPause++
		}
	}

	// The promoted standby, before any redelivery.
	promoted := admin(t, standby)
	present := map[string]bool{}
	rows, err := promoted.Query(`SELECT event_id FROM webhook_idempotency WHERE completed_at IS NOT NULL`)
	require.NoError(t, err)
	for rows.Next() {
		var e string
		require.NoError(t, rows.Scan(&e))
		present[e] = true
	}
	require.NoError(t, rows.Err())
	for e := range acked {
		if !present[e] {
			r.lost++
			r.lostEvents = append(r.lostEvents, e)
		}
	}

	// The redelivery pass: every event until it is answered 2xx, as a
	// sender retries (the pools reconnect to the new primary meanwhile).
	redeliver := func(rcv func(attempt int) *receiver, e string) answer {
		a, n := untilAnswered(t, rcv, e)
		r.redeliveries += n
		return a
	}
	var stale []string
	for i := range events {
		e := fmt.Sprintf("ev%03d", i)
		a := redeliver(func(attempt int) *receiver { return receivers[(i+attempt)%len(receivers)] }, e)
		prev, ok := acked[e]
		switch {
		case !ok:
		case a.body != prev:
			r.reanswered++
		case !present[e]:
			// A lost event answered from a receiver's replay cache, which
			// holds what the old primary answered for ReplayCacheTTL.
			require.True(t, a.replayed)
			stale = append(stale, e)
		default:
			require.True(t, a.replayed, "event %s answered the same without a replay", e)
		}
	}
	r.staleFromMemory = len(stale)
	// Those run again on a receiver restarted after the failover.
	restarted := newReceiver(t, "restarted", viaPgx, url, opts)
	for _, e := range stale {
		a := redeliver(func(int) *receiver { return restarted }, e)
		require.NotEqual(t, acked[e], a.body)
		r.reanswered++
	}

	// Every event processed exactly once on the new primary.
	requireOnce(t, promoted, events)
	t.Logf("%s replication: %v", mode, r)
	t.Logf("timings: clusters and receivers %v, storm %v, kill and promotion %v, redelivery %v",
		setup.Round(time.Millisecond), stormTime.Round(time.Millisecond), failoverTime.Round(time.Millisecond),
		(time.Since(start) - setup - stormTime - failoverTime).Round(time.Millisecond))
	return r
}

// newPair starts a primary named name+"_primary", with the tables, and a
// streaming standby of it, name+"_standby", synchronous or not; it returns
// them, an admin pool on the primary and the pid of the primary's
// walsender to the standby.
func newPair(t *testing.T, s *pgcluster.Set, name string, synchronous bool) (primary, standby *pgcluster.Cluster, adm *sql.DB, walsender int) {
	t.Helper()
	var conf []string
	if synchronous {
		conf = append(conf, "synchronous_standby_names = '"+name+"_standby'")
	}
	primary, err := s.Primary(name+"_primary", conf...)
	require.NoError(t, err)
	stopAtEnd(t, primary)
	adm = admin(t, primary)
	migrate(t, adm)
	// The promoted standby must not wait for a standby of its own.
	standby, err = primary.Standby(name+"_standby", "synchronous_standby_names = ''")
	require.NoError(t, err)
	stopAtEnd(t, standby)
	want := map[bool]string{true: "sync", false: "async"}[synchronous]
	poll(t, "the standby streams", 20*time.Second, func() (bool, error) {
		var state string
		err := adm.QueryRow(`SELECT pid, sync_state FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'`, standby.Name).Scan(&walsender, &state)
		return state == want, err
	})
	return primary, standby, adm, walsender
}

// check runs idemops.Check on c as an operator would (with the server's own
// synchronous_commit) and returns what it says of durability.
func check(t *testing.T, c *pgcluster.Cluster) idemops.Durability {
	t.Helper()
	db, err := c.Open("postgres")
	require.NoError(t, err)
	defer db.Close()
	r, err := idemops.Check(context.Background(), db, idemops.CheckOptions{})
	require.NoError(t, err)
	require.Empty(t, r.Findings, "durability is never a finding")
	return r.Durability
}

// untilAnswered delivers event until it is answered 2xx, as a sender
// retries after a 409 or a 503 (for instance while the pools reconnect to a
// new primary), and returns the answer and the number of deliveries.
func untilAnswered(t *testing.T, rcv func(attempt int) *receiver, event string) (answer, int) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		a := rcv(attempt).deliver(event)
		if a.status/100 == 2 {
			return a, attempt + 1
		}
		require.Contains(t, []int{http.StatusConflict, http.StatusServiceUnavailable}, a.status, a.body)
		require.Less(t, attempt, 200, "event %s is still not answered: %d %s", event, a.status, a.body)
		time.Sleep(20 * time.Millisecond) // the sender's back-off
	}
}

// requireOnce checks that db's ledger has one row for each of the events,
// and its idempotency table a completed key for each.
func requireOnce(t *testing.T, db *sql.DB, events int) {
	t.Helper()
	var keys, distinct, rows int
	require.NoError(t, db.QueryRow(`SELECT (SELECT count(*) FROM webhook_idempotency WHERE completed_at IS NOT NULL),
       (SELECT count(DISTINCT event_id) FROM ledger), (SELECT count(*) FROM ledger)`).Scan(&keys, &distinct, &rows))
	if rows != distinct {
		var doubled []string
		rs, err := db.Query(`SELECT event_id FROM ledger GROUP BY event_id HAVING count(*) > 1 ORDER BY 1`)
		require.NoError(t, err)
		for rs.Next() {
			var e string
			require.NoError(t, rs.Scan(&e))
			doubled = append(doubled, e)
		}
		t.Errorf("events processed twice: %s", strings.Join(doubled, ", "))
	}
	require.Equal(t, [3]int{events, events, events}, [3]int{keys, distinct, rows}, "completed keys, events in the ledger, ledger rows")
}
