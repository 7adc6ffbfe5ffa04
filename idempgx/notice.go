package idempgx

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DetectUnreplicatedCommits makes the middlewares of a pool built from cfg
// answer 503, not 2xx, when PostgreSQL reports that it committed the
// request's transaction locally without the confirmation of the
// synchronous standby it was waiting for. PostgreSQL does that when the
// wait is cancelled (pg_cancel_backend, or a client's CancelRequest): the
// COMMIT succeeds, with only the WARNING "canceling wait for synchronous
// replication due to user request". A failover before the standby catches
// up would lose such an event, though its sender got a 2xx.
//
// Call it before pgxpool.NewWithConfig. It wraps cfg.ConnConfig.OnNotice,
// keeping a handler already set. It counts any WARNING that the COMMIT
// itself answers (SQLSTATE 01000, which is also what RAISE WARNING in a
// deferred trigger sends), in any lc_messages language. Such a commit has
// happened: its redeliveries are replayed the stored answer, and the 503
// only makes the sender try again later, by when the standby has usually
// caught up. See docs/durability.md.
//
// The middleware itself never cancels a COMMIT; without this, only a
// cancel from outside (an operator, a statement killer) can turn an
// unreplicated commit into a 2xx.
func DetectUnreplicatedCommits(cfg *pgxpool.Config) {
	prev := cfg.ConnConfig.OnNotice
	cfg.ConnConfig.OnNotice = func(c *pgconn.PgConn, n *pgconn.Notice) {
		if data := c.CustomData(); data != nil && isWarning(n) {
			if _, watching := data[commitWarningKey]; watching {
				data[commitWarningKey] = n
			}
		}
		if prev != nil {
			prev(c, n)
		}
	}
}

// commitWarningKey marks, in a connection's CustomData, that a COMMIT's
// answer is being read; the notice handler of DetectUnreplicatedCommits
// stores a WARNING there.
const commitWarningKey = "github.com/pgidem/idem/idempgx.commitWarning"

func isWarning(n *pgconn.Notice) bool {
	sev := n.SeverityUnlocalized
	if sev == "" {
		sev = n.Severity
	}
	return sev == "WARNING" && n.Code == "01000"
}

// errUnreplicated is Commit's error when the COMMIT answered a WARNING.
var errUnreplicated = errors.New("idempgx: PostgreSQL committed locally, with a WARNING instead of the synchronous standby's confirmation; redeliveries get the stored answer")

// watchCommit starts watching for a WARNING to the COMMIT on c; the
// function it returns stops and returns the error for one, or nil.
func watchCommit(c *pgconn.PgConn) func() error {
	data := c.CustomData()
	if data == nil {
		return func() error { return nil }
	}
	data[commitWarningKey] = (*pgconn.Notice)(nil)
	return func() error {
		n, _ := data[commitWarningKey].(*pgconn.Notice)
		delete(data, commitWarningKey)
		if n == nil {
			return nil
		}
		return fmt.Errorf("%w: %s", errUnreplicated, n.Message)
	}
}
