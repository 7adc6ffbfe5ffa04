package failover

import (
	"bytes"
	"database/sql"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/pgcluster"
	"github.com/stretchr/testify/require"
)

// A COMMIT that waits for a synchronous standby that is away outlives
// HandlerTimeout: the answer is 503, never 2xx, and the COMMIT is not
// cancelled (a cancelled wait commits locally, unreplicated, with only a
// WARNING). While it waits the key is in flight (409); once the standby
// confirms (here: synchronous replication is turned off, which releases the
// wait as committed) the redelivery gets the stored answer, and the event
// was processed once. On each adapter, and with pgx's CancelRequest context
// watcher, which would cancel a COMMIT whose context ends.
// waitingPrimary starts a primary whose commits wait for a standby that
// never connects, with the tables, and returns it and an admin pool.
func waitingPrimary(t *testing.T, s *pgcluster.Set, name string) (*pgcluster.Cluster, *sql.DB) {
	t.Helper()
	c, err := s.Primary(name, "synchronous_standby_names = 'absent'")
	require.NoError(t, err)
	stopAtEnd(t, c)
	adm := admin(t, c)
	migrate(t, adm)
	return c, adm
}

func TestCommitWaitingForAnAbsentStandbyAnswers503(t *testing.T) {
	s := clusters(t)
	for _, via := range allVias {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			c, adm := waitingPrimary(t, s, "absent-"+via)
			logs := &syncBuffer{}
			rc := newReceiver(t, "r", via, c.URL("postgres"), idem.Options{HandlerTimeout: time.Second, LockWait: 50 * time.Millisecond,
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			require.Contains(t, check(t, c).Summary, `synchronous_standby_names is "absent" but no standby confirms commits now`)

			first := rc.deliver("e1")
			require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)

			// The COMMIT still waits: nothing is visible, and the key is in
			// flight for the redelivery.
			poll(t, "the COMMIT waits for the standby", 10*time.Second, func() (bool, error) {
				n, err := syncRepWaiters(adm)
				return n == 1, err
			})
			var keys, rows int
			require.NoError(t, adm.QueryRow(`SELECT (SELECT count(*) FROM webhook_idempotency), (SELECT count(*) FROM ledger)`).Scan(&keys, &rows))
			require.Equal(t, [2]int{0, 0}, [2]int{keys, rows}, "an unconfirmed commit is visible: it was cancelled")
			second := rc.deliver("e1")
			require.Equal(t, http.StatusConflict, second.status, second.body)

			// The standby confirms (synchronous replication off): committed.
			releaseWaits(t, adm)
			poll(t, "the waiting COMMIT completes", 10*time.Second, func() (bool, error) {
				var n int
				err := adm.QueryRow(`SELECT count(*) FROM webhook_idempotency WHERE completed_at IS NOT NULL`).Scan(&n)
				return n == 1, err
			})
			third := rc.deliver("e1")
			require.Equal(t, http.StatusOK, third.status, third.body)
			require.True(t, third.replayed, "the redelivery after the commit completed ran the handler again")
			require.NoError(t, adm.QueryRow(`SELECT count(*) FROM ledger`).Scan(&rows))
			require.Equal(t, 1, rows)
			poll(t, "the late COMMIT is logged", 10*time.Second, func() (bool, error) {
				return strings.Contains(logs.String(), "completed afterwards") && strings.Contains(logs.String(), "event_id=e1"), nil
			})
		})
	}
}

// A primary restarted while a COMMIT waited for its standby counts the
// COMMIT as committed (it was in the WAL): the event answered 503 is
// replayed to its redelivery, processed once.
func TestCommitWaitingDuringARestartCountsAsCommitted(t *testing.T) {
	s := clusters(t)
	for _, via := range []string{viaPgx, viaSQL} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			c, adm := waitingPrimary(t, s, "restart-"+via)
			rc := newReceiver(t, "r", via, c.URL("postgres"), idem.Options{HandlerTimeout: time.Second})

			first := rc.deliver("e1")
			require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
			poll(t, "the COMMIT waits for the standby", 10*time.Second, func() (bool, error) {
				n, err := syncRepWaiters(adm)
				return n == 1, err
			})
			require.NoError(t, c.Kill())
			require.NoError(t, c.Start())

			again, _ := untilAnswered(t, func(int) *receiver { return rc }, "e1")
			require.True(t, again.replayed, "the redelivery ran the handler again: %s", again.body)
			requireOnce(t, admin(t, c), 1) // a new pool: the old one's connections died with the server
		})
	}
}

// A COMMIT that waited for a standby that never got its WAL is lost with
// the primary: after the failover, the key answered 503 and then 409 is
// free, and its redelivery runs the handler on the new primary, once.
func TestCommitWaitingDuringAFailoverIsRunAgain(t *testing.T) {
	s := clusters(t)
	for _, via := range []string{viaPgx, viaSQL} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			p, sb, adm, walsender := newPair(t, s, "crash_"+via, true)
			rc := newReceiver(t, "r", via, pgcluster.MultiHostURL("postgres", p, sb),
				idem.Options{HandlerTimeout: time.Second, LockWait: 50 * time.Millisecond})
			warm := rc.deliver("e0") // replicated: survives the failover
			require.Equal(t, http.StatusOK, warm.status, warm.body)

			require.NoError(t, p.Pause(walsender))
			first := rc.deliver("e1")
			require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
			poll(t, "the COMMIT waits for the standby", 10*time.Second, func() (bool, error) {
				n, err := syncRepWaiters(adm)
				return n == 1, err
			})
			second := rc.deliver("e1")
			require.Equal(t, http.StatusConflict, second.status, second.body)

			require.NoError(t, p.Kill())
			require.NoError(t, sb.Promote())
			again, _ := untilAnswered(t, func(int) *receiver { return rc }, "e1")
			require.False(t, again.replayed, "a commit the standby never got was replayed: %s", again.body)
			replay, _ := untilAnswered(t, func(int) *receiver { return rc }, "e0")
			require.Equal(t, warm.body, replay.body)
			requireOnce(t, admin(t, sb), 2)
		})
	}
}

// A wait for the standby that someone else cancels (pg_cancel_backend) ends
// in a local commit that PostgreSQL reports as a success with a WARNING.
// With idempgx.DetectUnreplicatedCommits the answer is 503; without it, on
// pgx or database/sql, it is a 2xx, as docs/durability.md says. Either way
// the commit happened: the redelivery is replayed.
func TestCancelledWaitForTheStandby(t *testing.T) {
	s := clusters(t)
	for _, tc := range []struct {
		via    string
		status int
	}{{viaPgxDetecting, http.StatusServiceUnavailable}, {viaPgx, http.StatusOK}, {viaSQL, http.StatusOK}} {
		t.Run(tc.via, func(t *testing.T) {
			t.Parallel()
			c, adm := waitingPrimary(t, s, "cancelled-"+tc.via)
			rc := newReceiver(t, "r", tc.via, c.URL("postgres"), idem.Options{HandlerTimeout: time.Minute})

			got := make(chan answer, 1)
			go func() { got <- rc.deliver("e1") }()
			var pid int
			poll(t, "the COMMIT waits for the standby", 10*time.Second, func() (bool, error) {
				err := adm.QueryRow(`SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&pid)
				return err == nil, err
			})
			_, err := adm.Exec(`SELECT pg_cancel_backend($1)`, pid)
			require.NoError(t, err)
			first := <-got
			require.Equal(t, tc.status, first.status, first.body)

			again := rc.deliver("e1")
			require.Equal(t, http.StatusOK, again.status, again.body)
			require.True(t, again.replayed)
			requireOnce(t, adm, 1)
		})
	}
}

// syncBuffer is a bytes.Buffer for a logger written from several
// goroutines.
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
