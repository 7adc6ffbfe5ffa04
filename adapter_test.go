package idem_test

import (
	"context"
	"database/sql"
	"os"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/require"
)

// The behaviour suite runs on either adapter: IDEM_ADAPTER=pgx builds every
// fixture's middleware with idempgx.New on a pgx pool of the same database
// and cap; the default builds it with idem.New on the *sql.DB. The handlers
// reach the request's transaction through txFrom, whichever it is.
// scripts/test.sh runs the suite once for each.
var onPgx = os.Getenv("IDEM_ADAPTER") == "pgx"

// newMW builds a middleware on pool with the suite's adapter.
func newMW(t testing.TB, pool *sql.DB, opts idem.Options) (*idem.Middleware, error) {
	t.Helper()
	if !onPgx {
		return idem.New(pool, opts)
	}
	return idempgx.New(pgxPoolFor(t, pool), opts)
}

var pgxPools sync.Map // *sql.DB -> *pgxpool.Pool

// pgxPoolFor returns a pgx pool on the database of db, capped as db is (or
// at 20), one per db, closed when db's test ends.
func pgxPoolFor(t testing.TB, db *sql.DB) *pgxpool.Pool {
	t.Helper()
	if p, ok := pgxPools.Load(db); ok {
		return p.(*pgxpool.Pool)
	}
	dsn, ok := idem.DSNOf(db)
	require.True(t, ok, "the test opened this *sql.DB without recording its DSN")
	cfg, err := pgxpool.ParseConfig(dsn)
	require.NoError(t, err)
	cfg.MaxConns = 20
	if n := db.Stats().MaxOpenConnections; n > 0 {
		cfg.MaxConns = int32(n)
	}
	cfg.MinConns = 0
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	if prev, loaded := pgxPools.LoadOrStore(db, p); loaded {
		p.Close()
		return prev.(*pgxpool.Pool)
	}
	t.Cleanup(func() { pgxPools.Delete(db); p.Close() })
	return p
}

// testTx is the request's transaction, whichever adapter serves it, with
// database/sql's method names.
type testTx struct {
	s *sql.Tx
	p pgx.Tx
}

func txFrom(ctx context.Context) (testTx, bool) {
	if tx, ok := idem.Tx(ctx); ok {
		return testTx{s: tx}, true
	}
	if tx, ok := idempgx.Tx(ctx); ok {
		return testTx{p: tx}, true
	}
	return testTx{}, false
}

func (t testTx) ExecContext(ctx context.Context, q string, args ...any) (int64, error) {
	if t.s != nil {
		res, err := t.s.ExecContext(ctx, q, args...)
		if err != nil {
			return 0, err
		}
		return res.RowsAffected()
	}
	tag, err := t.p.Exec(ctx, q, args...)
	return tag.RowsAffected(), err
}

type scanner interface{ Scan(...any) error }

func (t testTx) QueryRowContext(ctx context.Context, q string, args ...any) scanner {
	if t.s != nil {
		return t.s.QueryRowContext(ctx, q, args...)
	}
	return t.p.QueryRow(ctx, q, args...)
}

func (t testTx) Commit() error {
	if t.s != nil {
		return t.s.Commit()
	}
	return t.p.Commit(context.Background())
}

func (t testTx) Rollback() error {
	if t.s != nil {
		return t.s.Rollback()
	}
	return t.p.Rollback(context.Background())
}

// poolWaits is how many times a request waited for a connection of db's
// pool (of the pgx pool standing for it in the pgx pass).
func poolWaits(t testing.TB, db *sql.DB) int64 {
	if onPgx {
		return pgxPoolFor(t, db).Stat().EmptyAcquireCount()
	}
	return db.Stats().WaitCount
}

// poolInUse is how many connections of db's pool are in use.
func poolInUse(t testing.TB, db *sql.DB) int {
	if onPgx {
		return int(pgxPoolFor(t, db).Stat().AcquiredConns())
	}
	return db.Stats().InUse
}

// newPgxPool opens a pgx pool on dsn, closed when t ends; it does not
// connect.
func newPgxPool(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), dsn)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// storeEvent is the table event that stores an answer, for a trigger that
// makes it fail: the UPDATE of the claim, or, on idempgx at READ COMMITTED
// (its claim takes the key's lock and reads; the completed row is inserted
// with the answer), the INSERT.
func storeEvent() string {
	if onPgx { // on either layout
		return "INSERT"
	}
	return "UPDATE"
}

// claimFirst returns opts such that a trigger on the table's INSERT fails
// the claim itself: on idempgx, REPEATABLE READ, under which it claims by
// inserting the key first, as database/sql does. At READ COMMITTED its
// claim writes nothing, and such failures cannot happen there. On a
// partitioned table idempgx claims at READ COMMITTED only (REPEATABLE READ
// is refused there): opts stay as they are, and tests of a failing claim
// INSERT ask claimInsertsAtStore.
func claimFirst(opts idem.Options) idem.Options {
	if onPgx && !idem.PartitionedLayout {
		opts.TxOptions = &sql.TxOptions{Isolation: sql.LevelRepeatableRead}
	}
	return opts
}

// claimInsertsAtStore: the claim inserts nothing, and the key's row is
// inserted with its answer when it is stored, after the handler: idempgx on
// a partitioned table, which claims lock-first at READ COMMITTED (as a
// first claim on a new table does, before any summary of past partitions:
// a claim that looks in some past partitions first inserts as it claims).
// A trigger that fails the table's INSERT fails the store there, not the
// claim.
func claimInsertsAtStore() bool { return onPgx && idem.PartitionedLayout }
