package failover

import (
	"net/http"
	"testing"
	"time"

	"github.com/pgidem/idem"
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
			c, err := s.Primary("absent-"+via, "synchronous_standby_names = 'absent'")
			require.NoError(t, err)
			stopAtEnd(t, c)
			adm := admin(t, c)
			migrate(t, adm)
			rc := newReceiver(t, "r", via, c.URL("postgres"), idem.Options{HandlerTimeout: 300 * time.Millisecond, LockWait: 50 * time.Millisecond})

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
