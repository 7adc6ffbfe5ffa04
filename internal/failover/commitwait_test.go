package failover

import (
	"net/http"
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
func TestCommitWaitingForAnAbsentStandbyAnswers503(t *testing.T) {
	s := clusters(t)
	for _, via := range allVias {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			c, err := s.Primary("absent-"+via, "synchronous_standby_names = 'absent'")
			require.NoError(t, err)
			stopAtEnd(t, c)
			adm := admin(t, c)
			migrate(t, adm)
			rc := newReceiver(t, "r", via, c.URL("postgres"), idem.Options{HandlerTimeout: time.Second, LockWait: 50 * time.Millisecond})
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
			c, err := s.Primary("restart-"+via, "synchronous_standby_names = 'absent'")
			require.NoError(t, err)
			stopAtEnd(t, c)
			adm := admin(t, c)
			migrate(t, adm)
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
			p, err := s.Primary("crash-"+via, "synchronous_standby_names = 'standby_"+via+"'")
			require.NoError(t, err)
			stopAtEnd(t, p)
			adm := admin(t, p)
			migrate(t, adm)
			sb, err := p.Standby("standby_"+via, "synchronous_standby_names = ''")
			require.NoError(t, err)
			stopAtEnd(t, sb)
			var walsender int
			poll(t, "the standby streams", 20*time.Second, func() (bool, error) {
				var state string
				err := adm.QueryRow(`SELECT pid, sync_state FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&walsender, &state)
				return state == "sync", err
			})
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
			c, err := s.Primary("cancelled-"+tc.via, "synchronous_standby_names = 'absent'")
			require.NoError(t, err)
			stopAtEnd(t, c)
			adm := admin(t, c)
			migrate(t, adm)
			rc := newReceiver(t, "r", tc.via, c.URL("postgres"), idem.Options{HandlerTimeout: time.Minute})

			got := make(chan answer, 1)
			go func() { got <- rc.deliver("e1") }()
			var pid int
			poll(t, "the COMMIT waits for the standby", 10*time.Second, func() (bool, error) {
				err := adm.QueryRow(`SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&pid)
				return err == nil, err
			})
			_, err = adm.Exec(`SELECT pg_cancel_backend($1)`, pid)
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
