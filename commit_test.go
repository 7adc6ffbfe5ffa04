package idem_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/benchref"
	"github.com/stretchr/testify/assert"
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
	var hooks phaseHooks
	m, err := idem.New(db, idem.Options{KeyFunc: idem.Header(benchSource, benchHeader), Observer: hooks.observe, OnPhase: hooks.onPhase})
	require.NoError(t, err)
	s := newBenchSender(m.Handler(benchref.IdemHandler("ledger")))
	require.PanicsWithValue(t, "commit hook", func() { s.send("evt_1", benchBody("evt_1")) })
	hooks.check(t, idem.PhaseDelivery, idem.PhaseClaim, idem.PhaseHandler, idem.PhaseCommit)
}

// A panic of the driver in the claim (single-transaction or lease mode)
// goes on too, and still ends the claim's phase and the delivery's, and
// calls the Observer, once each.
func TestPanicDuringClaimEndsItsPhases(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, time.Minute} {
		t.Run(fmt.Sprint("lease ", lease), func(t *testing.T) {
			t.Parallel()
			c := &panicClaimConnector{benchNoopConnector{answer: benchref.Answer(42, "evt_1")}}
			db := sql.OpenDB(c)
			t.Cleanup(func() { db.Close() })
			var hooks phaseHooks
			m, err := idem.New(db, idem.Options{KeyFunc: idem.Header(benchSource, benchHeader), Lease: lease, Observer: hooks.observe, OnPhase: hooks.onPhase})
			require.NoError(t, err)
			s := newBenchSender(m.Handler(benchref.IdemHandler("ledger")))
			require.PanicsWithValue(t, "claim hook", func() { s.send("evt_1", benchBody("evt_1")) })
			hooks.check(t, idem.PhaseDelivery, idem.PhaseClaim)
		})
	}
}

// phaseHooks records the phases OnPhase started and ended, and the
// Observations.
type phaseHooks struct {
	mu             sync.Mutex
	started, ended map[idem.Phase]int
	endErr         map[idem.Phase]error
	seen           []idem.Observation
}

func (h *phaseHooks) onPhase(ctx context.Context, p idem.Phase, _ idem.Key) (context.Context, func(error)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.started == nil {
		h.started, h.ended, h.endErr = map[idem.Phase]int{}, map[idem.Phase]int{}, map[idem.Phase]error{}
	}
	h.started[p]++
	return ctx, func(err error) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.ended[p]++
		h.endErr[p] = err
	}
}

func (h *phaseHooks) observe(o idem.Observation) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seen = append(h.seen, o)
}

// check asserts that exactly the phases want were started, each ended
// once, the delivery and the last one (the one that panicked) with an
// error, and that the Observer saw one failed delivery.
func (h *phaseHooks) check(t *testing.T, want ...idem.Phase) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.Len(t, h.started, len(want), "phases started: %v", h.started)
	for _, p := range want {
		assert.Equal(t, 1, h.started[p], "phase %v started once", p)
		assert.Equal(t, 1, h.ended[p], "phase %v ended once", p)
	}
	for _, p := range []idem.Phase{idem.PhaseDelivery, want[len(want)-1]} {
		assert.Error(t, h.endErr[p], "phase %v ended with the panic", p)
	}
	require.Len(t, h.seen, 1, "the Observer is called once")
	assert.Equal(t, idem.OutcomeStoreError, h.seen[0].Outcome)
	assert.Error(t, h.seen[0].Err)
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

// panicClaimConnector is the no-op driver that panics in the claim: at
// BEGIN, and at every statement but the middleware's first check of the
// table (is it partitioned?).
type panicClaimConnector struct{ benchNoopConnector }

func (c *panicClaimConnector) Connect(context.Context) (driver.Conn, error) {
	return panicClaimConn{&benchNoopConn{c: &c.benchNoopConnector}}, nil
}

type panicClaimConn struct{ *benchNoopConn }

func (panicClaimConn) BeginTx(context.Context, driver.TxOptions) (driver.Tx, error) {
	panic("claim hook")
}

func (c panicClaimConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	if strings.Contains(q, "relkind = 'p'") {
		return c.benchNoopConn.QueryContext(ctx, q, args)
	}
	panic("claim hook")
}

func (panicClaimConn) ExecContext(context.Context, string, []driver.NamedValue) (driver.Result, error) {
	panic("claim hook")
}
