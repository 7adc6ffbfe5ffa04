package idem_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/benchref"
	"github.com/stretchr/testify/require"
)

// The COMMIT runs on a goroutine of its own, so that the request can be
// answered 503 at HandlerTimeout while it waits for a synchronous standby
// (internal/failover tests that). A panic there (a driver's hook) still
// panics on the request's goroutine, where net/http recovers it, as it did
// when the COMMIT ran there: it does not crash the process.
func TestPanicDuringCommitPanicsTheRequest(t *testing.T) {
	t.Parallel()
	c := &panicCommitConnector{benchNoopConnector{answer: benchref.Answer(42, "evt_1")}}
	db := sql.OpenDB(c)
	t.Cleanup(func() { db.Close() })
	m, err := idem.New(db, idem.Options{KeyFunc: idem.Header(benchSource, benchHeader)})
	require.NoError(t, err)
	s := newBenchSender(m.Handler(benchref.IdemHandler("ledger")))
	require.PanicsWithValue(t, "commit hook", func() { s.send("evt_1", benchBody("evt_1")) })
}

// panicCommitConnector is the no-op driver whose COMMIT panics.
type panicCommitConnector struct{ benchNoopConnector }

func (c *panicCommitConnector) Connect(context.Context) (driver.Conn, error) {
	return panicCommitConn{&benchNoopConn{c: &c.benchNoopConnector}}, nil
}

type panicCommitConn struct{ *benchNoopConn }

func (c panicCommitConn) BeginTx(ctx context.Context, o driver.TxOptions) (driver.Tx, error) {
	tx, err := c.benchNoopConn.BeginTx(ctx, o)
	return panicCommitTx{tx}, err
}

type panicCommitTx struct{ driver.Tx }

func (panicCommitTx) Commit() error { panic("commit hook") }
