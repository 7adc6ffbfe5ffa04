package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMixedFleetReplaysEachOthersAnswers: during a move from database/sql
// to pgx, instances of both serve one table. Each replays the other's
// answers byte for byte, and an event runs once whichever instance gets
// its first delivery.
func TestMixedFleetReplaysEachOthersAnswers(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	opts := idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: f.table}
	viaSQL, err := idem.New(f.db, opts)
	require.NoError(t, err)
	viaPgx, err := idempgx.New(pgxPoolFor(t, f.db), opts)
	require.NoError(t, err)
	sqlSrv := httptest.NewServer(viaSQL.Handler(f.inner))
	t.Cleanup(sqlSrv.Close)
	pgxSrv := httptest.NewServer(viaPgx.Handler(f.inner))
	t.Cleanup(pgxSrv.Close)
	s := newSender(t)

	for i, pair := range [][2]string{{sqlSrv.URL, pgxSrv.URL}, {pgxSrv.URL, sqlSrv.URL}} {
		id := fmt.Sprintf("evt_%d", i)
		first, err := s.post(pair[0], id, `{"n": 1}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, first.status)
		again, err := s.post(pair[1], id, `{"n": 1}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, again.status)
		assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
		assert.Equal(t, first.body, again.body, "byte for byte")
		other, err := s.post(pair[1], id, `{"n": 2}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusUnprocessableEntity, other.status)
	}
	assert.Equal(t, 2, f.ledgerRows())
	assert.Equal(t, int64(2), f.runs.Load())
}

// TestPgxTxWorksAsAPgxTx: the handler's pgx.Tx does what a pgx.Tx does,
// inside the request's transaction: Exec, Query, QueryRow, SendBatch,
// CopyFrom, Prepare, LargeObjects, Conn, and Begin as a savepoint whose
// rollback undoes only its own writes. All of it commits with the answer.
func TestPgxTxWorksAsAPgxTx(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	mw := f.pgxMiddleware()
	var loOID uint32
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, ok := idempgx.Tx(ctx)
		require.True(t, ok)
		_, sqlOK := idem.Tx(ctx)
		assert.False(t, sqlOK, "idem.Tx has no *sql.Tx for a pgx request")
		ins := `INSERT INTO ` + f.ledger + ` (event_id, body) VALUES ($1, 'x')`

		_, err := tx.Exec(ctx, ins, "exec")
		require.NoError(t, err)
		var n int
		require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM `+f.ledger).Scan(&n))
		assert.Equal(t, 1, n, "the transaction sees its own write")
		rows, err := tx.Query(ctx, `SELECT event_id FROM `+f.ledger)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		assert.Equal(t, []string{"exec"}, ids)

		b := &pgx.Batch{}
		b.Queue(ins, "batch1")
		b.Queue(ins, "batch2")
		require.NoError(t, tx.SendBatch(ctx, b).Close())

		copied, err := tx.CopyFrom(ctx, pgx.Identifier{f.ledger}, []string{"event_id", "body"},
			pgx.CopyFromRows([][]any{{"copy1", []byte("x")}, {"copy2", []byte("x")}}))
		require.NoError(t, err)
		assert.Equal(t, int64(2), copied)

		_, err = tx.Prepare(ctx, "idem_test_ins", ins)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "idem_test_ins", "prepared")
		require.NoError(t, err)

		sp, err := tx.Begin(ctx)
		require.NoError(t, err)
		_, err = sp.Exec(ctx, ins, "rolled-back-savepoint")
		require.NoError(t, err)
		require.NoError(t, sp.Rollback(ctx), "a savepoint is the handler's to roll back")
		sp, err = tx.Begin(ctx)
		require.NoError(t, err)
		_, err = sp.Exec(ctx, ins, "released-savepoint")
		require.NoError(t, err)
		require.NoError(t, sp.Commit(ctx))

		lo := tx.LargeObjects()
		loOID, err = lo.Create(ctx, 0)
		require.NoError(t, err)
		obj, err := lo.Open(ctx, loOID, pgx.LargeObjectModeWrite)
		require.NoError(t, err)
		_, err = obj.Write([]byte("large"))
		require.NoError(t, err)
		require.NoError(t, obj.Close())

		assert.NotNil(t, tx.Conn())
		assert.Equal(t, byte('T'), tx.Conn().PgConn().TxStatus(), "still in the request's transaction")
		w.WriteHeader(http.StatusCreated)
	}))
	rec := serveDirect(t, h, "evt_tx")
	require.Equal(t, http.StatusCreated, rec.Code, "%s", rec.Body)

	rows, err := f.db.Query(`SELECT event_id FROM ` + f.ledger + ` ORDER BY id`)
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		got = append(got, s)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"exec", "batch1", "batch2", "copy1", "copy2", "prepared", "released-savepoint"}, got)
	var size int
	require.NoError(t, f.db.QueryRow(`SELECT length(lo_get($1))`, loOID).Scan(&size))
	assert.Equal(t, 5, size, "the large object committed with the answer")
	_, _ = f.db.Exec(`SELECT lo_unlink($1)`, loOID)
	assert.Equal(t, 1, f.keys())
}

// TestPgxTxIsClosedAfterTheRequest: a handle kept past the request fails
// with pgx.ErrTxClosed instead of using a connection back in the pool.
func TestPgxTxIsClosedAfterTheRequest(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	mw := f.pgxMiddleware()
	var kept pgx.Tx
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kept, _ = idempgx.Tx(r.Context())
		w.WriteHeader(http.StatusCreated)
	}))
	require.Equal(t, http.StatusCreated, serveDirect(t, h, "evt_kept").Code)
	_, err := kept.Exec(context.Background(), `SELECT 1`)
	assert.ErrorIs(t, err, pgx.ErrTxClosed)
	assert.ErrorIs(t, kept.QueryRow(context.Background(), `SELECT 1`).Scan(new(int)), pgx.ErrTxClosed)
	assert.ErrorIs(t, kept.Commit(context.Background()), pgx.ErrTxClosed)
}

// TestIdempgxNewNeedsNoServer: New does not touch the database; a request
// while it is down is answered 503 with Retry-After, and the handler does
// not run.
func TestIdempgxNewNeedsNoServer(t *testing.T) {
	t.Parallel()
	cfgURL := "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2"
	pool := newPgxPool(t, cfgURL)
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id")})
	require.NoError(t, err)
	ran := false
	rec := serveDirect(t, mw.Handler(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { ran = true })), "evt_1")
	assert.Equal(t, http.StatusServiceUnavailable, rec.Code)
	assert.Equal(t, "1", rec.Header().Get("Retry-After"))
	assert.False(t, ran)

	_, err = idempgx.New(nil, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id")})
	assert.Error(t, err)
}

// TestIdempgxNewWarnsOfAMultiHostURLWithoutConnectTimeout: a host that
// does not answer would hold every new connection, and the next host would
// never be tried; New says so, once, and still returns the middleware.
func TestIdempgxNewWarnsOfAMultiHostURLWithoutConnectTimeout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url, warning string
	}{
		{"postgres://postgres@127.0.0.1:1,127.0.0.1:2/none?sslmode=disable&target_session_attrs=read-write", "names 2 hosts (127.0.0.1:1, 127.0.0.1:2) but no connect_timeout"},
		{"postgres://postgres@127.0.0.1:1,127.0.0.1:2/none?sslmode=disable&target_session_attrs=read-write&connect_timeout=5", ""},
		{"postgres://postgres@127.0.0.1:1/none?sslmode=disable", ""},
	} {
		var logs testdb.LogBuffer
		_, err := idempgx.New(newPgxPool(t, tc.url), idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"),
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		require.NoError(t, err)
		if tc.warning == "" {
			assert.Empty(t, logs.String(), tc.url)
			continue
		}
		assert.Contains(t, logs.String(), "level=WARN")
		assert.Contains(t, logs.String(), tc.warning)
		assert.Equal(t, 1, strings.Count(logs.String(), "\n"), "one record")
	}
}

// TestOperationsFromAPgxPool: sweep, check and stats take a *sql.DB; the
// one-liner of docs/pgx.md, stdlib.OpenDBFromPool, gives them one on a pgx
// pool's connections, and they see the keys idempgx stored.
func TestOperationsFromAPgxPool(t *testing.T) {
	t.Parallel()
	f := newPlainFixture(t, idem.Options{}, nil) // the row-by-row sweep; partition_test.go sweeps partitions
	pool := pgxPoolFor(t, f.db)
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: f.table})
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, serveDirect(t, mw.Handler(f.inner), "evt_ops").Code)

	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	ctx := context.Background()
	st, err := idemops.Stats(ctx, db, idemops.StatsOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), st.Rows)
	r, err := idemops.Check(ctx, db, idemops.CheckOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.Rows)
	d, err := idemops.ReadDurability(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, r.Durability.Summary, d.Summary)
	_, err = f.db.Exec(`UPDATE "` + f.table + `" SET claimed_at = now() - interval '60 days'`)
	require.NoError(t, err)
	res, err := idemops.Sweep(ctx, db, idemops.SweepOptions{Table: f.table})
	require.NoError(t, err)
	assert.Equal(t, int64(1), res.Removed)
	assert.Equal(t, 0, f.keys())
}

// TestPgxHandlerEndingTheTransactionWithSQL: a handler that sends ROLLBACK
// (or COMMIT) through Exec has ended idem's transaction: never a 2xx, no
// answer stored; idem cannot tell which it sent, and a COMMIT has committed
// the handler's writes, so the key is kept claimed without an answer, as on
// database/sql: its redelivery gets 409, not a second run.
func TestPgxHandlerEndingTheTransactionWithSQL(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	mw := f.pgxMiddleware()
	misbehave := true
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if misbehave {
			tx, _ := idempgx.Tx(r.Context())
			_, err := tx.Exec(r.Context(), "ROLLBACK")
			require.NoError(t, err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	rec := serveDirect(t, h, "evt_sql_rollback")
	assert.Equal(t, http.StatusInternalServerError, rec.Code)
	var answered int
	require.NoError(t, f.db.QueryRow(`SELECT count(*) FROM "`+f.table+`" WHERE completed_at IS NOT NULL`).Scan(&answered))
	assert.Equal(t, 0, answered, "no answer stored")
	assert.Equal(t, 1, f.keys(), "the key kept, claimed without an answer")
	misbehave = false
	rec = serveDirect(t, h, "evt_sql_rollback")
	assert.Equal(t, http.StatusConflict, rec.Code, "the redelivery is not run")
}

// TestPgxSavepointIsClosedAfterTheRequest: a savepoint kept past the
// request fails instead of using a connection back in the pool.
func TestPgxSavepointIsClosedAfterTheRequest(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	mw := f.pgxMiddleware()
	var kept pgx.Tx
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idempgx.Tx(r.Context())
		var err error
		kept, err = tx.Begin(r.Context())
		require.NoError(t, err)
		w.WriteHeader(http.StatusCreated)
	}))
	require.Equal(t, http.StatusCreated, serveDirect(t, h, "evt_sp").Code)
	_, err := kept.Exec(context.Background(), `SELECT 1`)
	assert.ErrorIs(t, err, pgx.ErrTxClosed)
	assert.ErrorIs(t, kept.Commit(context.Background()), pgx.ErrTxClosed)
	_, err = kept.Begin(context.Background())
	assert.ErrorIs(t, err, pgx.ErrTxClosed)
}

// TestPgxClaimsAtReadCommittedWhateverTheServerDefault: with TxOptions nil
// idempgx states READ COMMITTED, which its claim is built for, even where
// the server's default_transaction_isolation says otherwise.
func TestPgxClaimsAtReadCommittedWhateverTheServerDefault(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{}, nil)
	u, err := url.Parse(idem.TestDatabaseURL(t))
	require.NoError(t, err)
	role := newRole(t, f.db, `SET default_transaction_isolation = 'repeatable read'`)
	u.User = url.User(role)
	pool := newPgxPool(t, u.String())
	mw, err := idempgx.New(pool, idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: f.table})
	require.NoError(t, err)
	var level string
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idempgx.Tx(r.Context())
		require.NoError(t, tx.QueryRow(r.Context(), `SHOW transaction_isolation`).Scan(&level))
		w.WriteHeader(http.StatusCreated)
	}))
	require.Equal(t, http.StatusCreated, serveDirect(t, h, "evt_rc").Code)
	assert.Equal(t, "read committed", level)
	var def string
	require.NoError(t, pool.QueryRow(context.Background(), `SHOW default_transaction_isolation`).Scan(&def))
	assert.Equal(t, "repeatable read", def, "the role's default is not read committed")
}

// pgxMiddleware is an idempgx middleware on f's table and database.
func (f *fixture) pgxMiddleware() *idem.Middleware {
	f.t.Helper()
	mw, err := idempgx.New(pgxPoolFor(f.t, f.db), idem.Options{KeyFunc: idem.Header("test", "X-Event-Id"), Table: f.table})
	require.NoError(f.t, err)
	return mw
}
