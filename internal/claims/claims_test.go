package claims

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgidem/idem/internal/driver"
	"github.com/pgidem/idem/internal/summary"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The decisions of a claim, tested once for both adapters against a fake
// Pool that records every batch it is given, by the names of the Queries
// fields its statements are ("BEGIN(read committed) TryLock Read"), and
// answers each statement as a test scripts it. The real adapters, which
// carry these batches to PostgreSQL, are tested by the behaviour suites of
// packages idem and idempgx.

// fakePool is a driver.Pool that records and answers.
type fakePool struct {
	pipelines   bool
	partitioned bool
	citus       bool // the table is distributed by Citus (citus_test.go)
	names       map[string]string
	answers     map[string][]func(*driver.Stmt) error
	log         []string
}

func newFake(pipelines bool, cur *summary.Current) *fakePool {
	p := &fakePool{pipelines: pipelines, names: map[string]string{}, answers: map[string][]func(*driver.Stmt) error{}}
	name := func(prefix string, q driver.Queries) {
		v := reflect.ValueOf(q)
		for i := 0; i < v.NumField(); i++ {
			if sqlText := v.Field(i).String(); sqlText != "" {
				if _, ok := p.names[sqlText]; !ok {
					p.names[sqlText] = prefix + v.Type().Field(i).Name
				}
			}
		}
	}
	name("", driver.NewQueries(`"t"`))
	if cur != nil {
		name("cur.", cur.Queries)
	}
	p.names[summary.TryLockAt] = "TryLockAt"
	return p
}

// answer scripts the next answers to the statement named, in order; the
// last one answers every time after. Unscripted, a statement returns no
// row, or changes one.
func (p *fakePool) answer(name string, fs ...func(*driver.Stmt) error) {
	p.answers[name] = append(p.answers[name], fs...)
}

func (p *fakePool) Acquire(context.Context) (driver.Conn, error) { return &fakeConn{p: p}, nil }
func (p *fakePool) Pipelines() bool                              { return p.pipelines }
func (p *fakePool) Cap() int                                     { return 10 }
func (p *fakePool) Query(_ context.Context, q string, _ []any, each func(func(...any) error) error) error {
	switch q {
	case driver.LayoutSQL:
		p.log = append(p.log, "layout?")
		return each(func(dest ...any) error {
			*dest[0].(**bool), *dest[1].(**bool) = &p.partitioned, &p.citus
			return nil
		})
	case driver.DistributedSQL:
		p.log = append(p.log, "distributed?")
		return each(func(dest ...any) error {
			*dest[0].(*bool) = p.citus
			return nil
		})
	}
	return errors.New("unexpected query")
}

type fakeConn struct {
	p      *fakePool
	closed bool
}

func (c *fakeConn) Handle() any { return c }
func (c *fakeConn) Close(context.Context) error {
	if !c.closed {
		c.closed = true
		c.p.log = append(c.p.log, "close")
	}
	return nil
}

func (c *fakeConn) Send(_ context.Context, b *driver.Batch) error {
	var words []string
	if b.Begin != nil {
		iso, err := driver.IsoLevel(b.Begin)
		if err != nil {
			return err
		}
		words = append(words, "BEGIN("+iso+")")
	}
	for _, s := range b.Stmts {
		n, ok := c.p.names[s.SQL]
		if !ok {
			n = "?" + s.SQL
		}
		words = append(words, n)
	}
	switch {
	case b.Commit:
		words = append(words, "COMMIT")
	case b.Rollback:
		words = append(words, "ROLLBACK")
	}
	c.p.log = append(c.p.log, strings.Join(words, " "))
	for i := range b.Stmts {
		s := &b.Stmts[i]
		name := c.p.names[s.SQL]
		if fs := c.p.answers[name]; len(fs) > 0 {
			if len(fs) > 1 {
				c.p.answers[name] = fs[1:]
			}
			if err := fs[0](s); err != nil {
				return err
			}
			continue
		}
		if s.Dest != nil {
			s.NoRow = true
		} else {
			s.N = 1
		}
	}
	return nil
}

// Answers: values for a statement's destinations.
func values(vs ...any) func(*driver.Stmt) error {
	return func(s *driver.Stmt) error {
		for i, v := range vs {
			if v != nil {
				reflect.ValueOf(s.Dest[i]).Elem().Set(reflect.ValueOf(v))
			}
		}
		return nil
	}
}

// completed are a completed row's columns (driver.Scan), after lead.
func completed(lead ...any) func(*driver.Stmt) error {
	return values(append(lead, []byte("digest"), int64(201), []byte(nil), []byte("stored"), true, false, time.Duration(0))...)
}

func changed(n int64) func(*driver.Stmt) error {
	return func(s *driver.Stmt) error { s.N = n; return nil }
}

func failWith(code string) func(*driver.Stmt) error {
	return func(*driver.Stmt) error { return &pgconn.PgError{Code: code} }
}

var args = &driver.Args{Source: "s", EventID: "e", Digest: []byte("digest"), Lock: 7}

func newStore(t *testing.T, p *fakePool, opts *sql.TxOptions) *Store {
	s, err := New(p, driver.NewQueries(`"t"`), opts)
	require.NoError(t, err)
	return s
}

var rr = &sql.TxOptions{Isolation: sql.LevelRepeatableRead}

// flow is one way a decision goes: on a Pool that pipelines or not, with
// the user's options, and the batches it sends.
type flow struct {
	name      string
	pipelines bool
	opts      *sql.TxOptions
	want      []string
}

// eachFlow runs do on a new fake Pool and Store for each flow, scripted
// by script, and compares the batches sent with the flow's.
func eachFlow(t *testing.T, flows []flow, script func(*fakePool), do func(t *testing.T, s *Store)) {
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			p := newFake(f.pipelines, nil)
			script(p)
			do(t, newStore(t, p, f.opts))
			assert.Equal(t, f.want, p.log)
		})
	}
}

// A new key: pgx takes its lock and reads its row with BEGIN, then inserts
// it completed with COMMIT; database/sql inserts it first, one statement
// each.
func TestANewKey(t *testing.T) {
	ctx := context.Background()
	eachFlow(t, []flow{
		{"pipelined", true, nil, []string{"layout?", "BEGIN(read committed) TryLock Read", "InsertCompleted COMMIT", "close"}},
		{"pipelined, repeatable read", true, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "CompleteOrFail COMMIT", "close"}},
		{"one by one", false, nil, []string{"layout?", "BEGIN() Claim", "Complete", "COMMIT", "close"}},
	}, func(p *fakePool) {
		p.answer("TryLock", values(true))
		p.answer("Claim", values(true))
	}, func(t *testing.T, s *Store) {
		b, err := s.Begin(ctx, args)
		require.NoError(t, err)
		require.True(t, b.Won)
		require.NoError(t, b.Tx.Commit(ctx, args, 201, nil, []byte("ok")))
		require.NoError(t, b.Tx.Rollback(ctx))
	})
}

// A redelivery of a completed key reads its answer. Above READ COMMITTED
// the lookup ends the transaction in its own batch: a snapshot taken
// before a wait could not see what the wait waited for.
func TestACompletedKey(t *testing.T) {
	ctx := context.Background()
	eachFlow(t, []flow{
		{"pipelined", true, nil, []string{"layout?", "BEGIN(read committed) TryLock Read", "close"}},
		{"pipelined, repeatable read", true, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "Lookup ROLLBACK", "close"}},
		{"one by one", false, nil, []string{"layout?", "BEGIN() Claim", "Lookup", "close"}},
		{"one by one, repeatable read", false, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "Lookup ROLLBACK", "close"}},
	}, func(p *fakePool) {
		p.answer("TryLock", values(false))
		p.answer("Read", completed())
		p.answer("Lookup", completed(false))
	}, func(t *testing.T, s *Store) {
		b, err := s.Begin(ctx, args)
		require.NoError(t, err)
		assert.False(t, b.Won)
		assert.Equal(t, driver.Completed, b.Row.State)
		assert.Equal(t, []byte("stored"), b.Row.Body)
		require.NoError(t, b.Tx.Rollback(ctx))
	})
}

// A key in flight: the wait, then a lookup whose snapshot comes after it;
// the original rolled back, so the key is claimed in this transaction.
func TestAWaitThatEndsInAClaim(t *testing.T) {
	ctx := context.Background()
	eachFlow(t, []flow{
		{"pipelined", true, nil, []string{"layout?", "BEGIN(read committed) TryLock Read", "Wait", "LookupRestoring", "InsertCompleted COMMIT", "close"}},
		{"pipelined, repeatable read", true, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "Lookup ROLLBACK",
			"BEGIN(repeatable read) Wait", "LookupRestoring", "Claim", "CompleteOrFail COMMIT", "close"}},
		{"one by one", false, nil, []string{"layout?", "BEGIN() Claim", "Lookup", "Wait", "LookupRestoring", "Claim", "Complete", "COMMIT", "close"}},
	}, func(p *fakePool) {
		p.answer("TryLock", values(false))
		p.answer("Lookup", values(false))
		p.answer("Wait", values("0", nil))
		p.answer("LookupRestoring", values(true))
		p.answer("Claim", func(s *driver.Stmt) error { s.NoRow = true; return nil }, values(true))
	}, func(t *testing.T, s *Store) {
		b, err := s.Begin(ctx, args)
		require.NoError(t, err)
		require.False(t, b.Won)
		require.Equal(t, driver.InFlight, b.Row.State)
		row, err := b.Tx.Wait(ctx, args, time.Second)
		require.NoError(t, err)
		require.Equal(t, driver.Free, row.State)
		won, err := b.Tx.Claim(ctx, args)
		require.NoError(t, err)
		require.True(t, won)
		require.NoError(t, b.Tx.Commit(ctx, args, 200, nil, nil))
	})
}

// An answer that finds no claim to complete is ErrNotStored, and nothing
// commits: pipelined, the statement itself fails before the COMMIT behind
// it; one by one, COMMIT is not sent.
func TestAnAnswerThatStoresNothingDoesNotCommit(t *testing.T) {
	ctx := context.Background()
	eachFlow(t, []flow{
		{"pipelined", true, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "CompleteOrFail COMMIT", "close"}},
		{"one by one", false, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "Complete", "close"}},
	}, func(p *fakePool) {
		p.answer("Claim", values(true))
		p.answer("CompleteOrFail", failWith("22012"))
		p.answer("Complete", changed(0))
	}, func(t *testing.T, s *Store) {
		b, err := s.Begin(ctx, args)
		require.NoError(t, err)
		err = b.Tx.Commit(ctx, args, 200, nil, nil)
		require.ErrorIs(t, err, driver.ErrNotStored)
		require.NoError(t, b.Tx.Rollback(ctx))
	})
}

// A lease that ran out is taken over with an UPDATE, and the answer is then
// an UPDATE too, even where a key won lock-first is inserted at the end.
func TestATakeOverIsCompletedByAnUpdate(t *testing.T) {
	ctx := context.Background()
	p := newFake(true, nil)
	p.answer("TryLock", values(true))
	p.answer("Read", values([]byte("old"), int64(0), []byte(nil), []byte(nil), false, true, time.Duration(-1)))
	s := newStore(t, p, nil)
	b, err := s.Begin(ctx, args)
	require.NoError(t, err)
	require.Equal(t, driver.LeaseExpired, b.Row.State)
	won, err := b.Tx.TakeOver(ctx, args)
	require.NoError(t, err)
	require.True(t, won)
	require.NoError(t, b.Tx.Commit(ctx, args, 200, nil, nil))
	assert.Equal(t, []string{"layout?", "BEGIN(read committed) TryLock Read", "TakeOver", "CompleteOrFail COMMIT", "close"}, p.log)
}

// A handler that ended the transaction itself, lock-first, has left its
// key without a row: it is recorded as claimed without an answer, so that
// no redelivery runs it again.
func TestAHandlerThatEndedTheTransactionLeavesAClaim(t *testing.T) {
	ctx := context.Background()
	p := newFake(true, nil)
	p.answer("TryLock", values(true))
	p.answer("InsertCompleted", func(*driver.Stmt) error { return fmt.Errorf("%w: %w", driver.ErrTxDone, driver.ErrTxEnded) })
	s := newStore(t, p, nil)
	b, err := s.Begin(ctx, args)
	require.NoError(t, err)
	require.ErrorIs(t, b.Tx.Commit(ctx, args, 200, nil, nil), driver.ErrTxEnded)
	require.NoError(t, b.Tx.Rollback(ctx))
	assert.Equal(t, []string{"layout?", "BEGIN(read committed) TryLock Read", "InsertCompleted COMMIT", "InsertUnanswered", "close"}, p.log)
}

// fakePast are summaries that answer as a test says.
type fakePast struct {
	answered *driver.Row
	current  *summary.Current
}

func (f fakePast) Answered(context.Context, *driver.Args, time.Time) (driver.Row, bool, error) {
	if f.answered != nil {
		return *f.answered, true, nil
	}
	return driver.Row{}, false, nil
}

func (f fakePast) Fast(*driver.Args, time.Time) *summary.Current { return f.current }

// current is the current partition "cur" of table "t", with "past" the
// past partition that may hold the key, or none.
func current(past bool) *summary.Current {
	var ps []string
	if past {
		ps = []string{`"past"`}
	}
	c := &summary.Current{Queries: driver.PartitionQueries(driver.NewQueries(`"t"`), `"cur"`, ps), From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Hour)}
	if !past {
		c.ClaimPast = ""
	}
	return c
}

func partitionedStore(t *testing.T, p *fakePool, opts *sql.TxOptions, f fakePast) *Store {
	p.partitioned = true
	s := newStore(t, p, opts)
	s.past = func() past { return f }
	return s
}

// Where a partitioned table's claim goes: answered from a past partition
// without a transaction; on the current partition, as on a plain table or
// after looking in the past partitions that may hold the key; across every
// partition without summaries, or when the claim on the current partition
// began past its end.
func TestThePartitionsAClaimGoesTo(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	for _, c := range []struct {
		name      string
		pipelines bool
		past      fakePast
		script    func(p *fakePool)
		want      []string
		won       bool
	}{
		{"answered from a past partition", true, fakePast{answered: &driver.Row{State: driver.Completed}}, nil,
			[]string{"layout?"}, false},
		{"the current partition, pipelined", true, fakePast{current: current(false)}, func(p *fakePool) { p.answer("TryLockAt", values(true, now)) },
			[]string{"layout?", "BEGIN(read committed) TryLockAt cur.Read", "cur.InsertCompleted COMMIT", "close"}, true},
		{"the current partition, one by one", false, fakePast{current: current(false)}, func(p *fakePool) { p.answer("cur.Claim", values(true)) },
			[]string{"layout?", "BEGIN(read committed) cur.Claim", "cur.Complete", "COMMIT", "close"}, true},
		{"after a past partition", true, fakePast{current: current(true)}, func(p *fakePool) { p.answer("cur.ClaimPast", values(true, now)) },
			[]string{"layout?", "BEGIN(read committed) cur.ClaimPast", "cur.CompleteOrFail COMMIT", "close"}, true},
		{"every partition, pipelined", true, fakePast{}, func(p *fakePool) { p.answer("TryLock", values(true)) },
			[]string{"layout?", "BEGIN(read committed) TryLock Read", "InsertCompleted COMMIT", "close"}, true},
		{"every partition, one by one", false, fakePast{}, func(p *fakePool) {
			p.answer("TryLock", values(true))
			p.answer("ClaimOrRead", values(true))
		}, []string{"layout?", "BEGIN(read committed) TryLock", "ClaimOrRead", "CompleteClaimedNow", "COMMIT", "close"}, true},
		{"every partition, after beginning past the current one's end", true, fakePast{current: current(false)}, func(p *fakePool) {
			p.answer("TryLockAt", values(true, now.Add(2*time.Hour)))
			p.answer("TryLock", values(true))
		}, []string{"layout?", "BEGIN(read committed) TryLockAt cur.Read", "ROLLBACK", "BEGIN(read committed) TryLock Read", "InsertCompleted COMMIT", "close"}, true},
		{"every partition, after a past partition dropped", false, fakePast{current: current(true)}, func(p *fakePool) {
			p.answer("cur.ClaimPast", failWith("42P01"))
			p.answer("TryLock", values(true))
			p.answer("ClaimOrRead", values(true))
		}, []string{"layout?", "BEGIN(read committed) cur.ClaimPast", "ROLLBACK", "BEGIN(read committed) TryLock", "ClaimOrRead", "CompleteClaimedNow", "COMMIT", "close"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newFake(c.pipelines, c.past.current)
			if c.script != nil {
				c.script(p)
			}
			s := partitionedStore(t, p, nil, c.past)
			b, err := s.Begin(ctx, args)
			require.NoError(t, err)
			require.Equal(t, c.won, b.Won)
			if b.Answered {
				require.Nil(t, b.Tx)
			} else {
				require.NoError(t, b.Tx.Commit(ctx, args, 200, nil, nil))
			}
			assert.Equal(t, c.want, p.log)
		})
	}
}

// A partitioned table's claims need READ COMMITTED: a higher level is
// refused before anything is sent.
func TestAPartitionedTableRefusesAHigherIsolationLevel(t *testing.T) {
	p := newFake(true, nil)
	s := partitionedStore(t, p, rr, fakePast{})
	_, err := s.Begin(context.Background(), args)
	require.ErrorIs(t, err, driver.ErrPartitionedIsolation)
	assert.Equal(t, []string{"layout?"}, p.log)
}

// A plain claim on a table that has become partitioned (no unique index
// for ON CONFLICT) asks the layout again and claims as on a partitioned
// table, or refuses as one does.
func TestATableThatBecamePartitionedIsClaimedAsOne(t *testing.T) {
	for _, c := range []struct {
		name      string
		pipelines bool
		opts      *sql.TxOptions
		want      []string
		err       error
	}{
		{"one by one", false, nil, []string{"layout?", "BEGIN() Claim", "close", "layout?", "BEGIN(read committed) TryLock", "ClaimOrRead"}, nil},
		{"pipelined, repeatable read", true, rr, []string{"layout?", "BEGIN(repeatable read) Claim", "close", "layout?"}, driver.ErrPartitionedIsolation},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newFake(c.pipelines, nil)
			p.answer("TryLock", values(true))
			p.answer("ClaimOrRead", values(true))
			p.answer("Claim", func(*driver.Stmt) error {
				p.partitioned = true // converted while the application ran
				return &pgconn.PgError{Code: driver.NoConflictTarget}
			})
			s := newStore(t, p, c.opts)
			s.past = func() past { return fakePast{} }
			b, err := s.Begin(context.Background(), args)
			if c.err != nil {
				require.ErrorIs(t, err, c.err)
			} else {
				require.NoError(t, err)
				require.True(t, b.Won)
			}
			assert.Equal(t, c.want, p.log)
		})
	}
}

// Lease mode: the claim commits on its own; a key it does not claim is
// read by a second statement; a completion whose token lost the key is
// ErrFenced.
func TestTheLeaseClaim(t *testing.T) {
	ctx := context.Background()
	p := newFake(true, nil)
	p.answer("ClaimLease", values(false), func(s *driver.Stmt) error { s.NoRow = true; return nil })
	p.answer("Lookup", values(false, []byte("digest"), int64(0), []byte(nil), []byte(nil), false, true, time.Minute))
	s := newStore(t, p, nil)
	l, err := s.ClaimLease(ctx, args, time.Minute, time.Second, 42)
	require.NoError(t, err)
	assert.True(t, l.Won)
	assert.Equal(t, int64(42), l.Token)
	l, err = s.ClaimLease(ctx, args, time.Minute, time.Second, 43)
	require.NoError(t, err)
	assert.False(t, l.Won)
	assert.Equal(t, driver.LeaseLive, l.Row.State)
	require.NoError(t, s.ExtendLease(ctx, args, 42, time.Minute))
	p.answer("ExtendLease", changed(0))
	require.ErrorIs(t, s.ExtendLease(ctx, args, 42, time.Minute), driver.ErrFenced)
	p.answer("CompleteLease", changed(0))
	require.ErrorIs(t, s.CompleteLease(ctx, args, 42, 200, nil, nil), driver.ErrFenced)
	require.NoError(t, s.EndLease(ctx, args, 42, true))
	assert.Equal(t, []string{"layout?", "ClaimLease", "close", "ClaimLease", "Lookup", "close", "ExtendLease", "close", "ExtendLease", "close",
		"CompleteLease COMMIT", "close", "KeepClaim", "close"}, p.log)
}

// A lease-mode handler's transaction commits its answer fenced by its
// token: in the COMMIT's round trip where the Pool pipelines.
func TestTheLeaseCompletion(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		pipelines bool
		want      []string
	}{
		{true, []string{"BEGIN(read committed)", "CompleteLeaseOrFail COMMIT", "close"}},
		{false, []string{"BEGIN()", "CompleteLease", "COMMIT", "close"}},
	} {
		p := newFake(c.pipelines, nil)
		s := newStore(t, p, nil)
		tx, err := s.BeginLease(ctx)
		require.NoError(t, err)
		require.NoError(t, tx.Complete(ctx, args, 42, 200, nil, nil))
		assert.Equal(t, c.want, p.log)
	}
}

// On a partitioned table the lease claim takes the lock first, in a
// transaction of its own at READ COMMITTED whatever the options.
func TestTheLeaseClaimOnAPartitionedTable(t *testing.T) {
	p := newFake(false, nil)
	p.answer("TryLock", values(true))
	took := false
	p.answer("ClaimLeaseOrRead", values(&took))
	s := partitionedStore(t, p, rr, fakePast{})
	l, err := s.ClaimLease(context.Background(), args, time.Minute, time.Second, 42)
	require.NoError(t, err)
	assert.True(t, l.Won)
	assert.False(t, l.TookOver)
	assert.Equal(t, []string{"layout?", "BEGIN(read committed) TryLock", "ClaimLeaseOrRead COMMIT", "close"}, p.log)
}

// An isolation level PostgreSQL does not have is refused when the
// middleware is built, not per request.
func TestAnUnknownIsolationLevelIsRefused(t *testing.T) {
	_, err := New(newFake(true, nil), driver.NewQueries(`"t"`), &sql.TxOptions{Isolation: sql.LevelLinearizable})
	require.ErrorContains(t, err, "not supported by PostgreSQL")
}
