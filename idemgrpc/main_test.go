package idemgrpc_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/pgidem/idem/idempgx"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The tests run a real gRPC server on loopback TCP against PostgreSQL, in a
// database of their own (DATABASE_URL, default the local server), and fail
// when it is missing.
var (
	db    *sql.DB
	dbURL string
)

func TestMain(m *testing.M) {
	u, drop, err := createDatabase("idemgrpc_test")
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemgrpc tests: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	db.SetMaxOpenConns(20)
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "idemgrpc tests: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idemgrpc tests: goroutines left:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var seq atomic.Int64

// adapters are the two ways to build a middleware: idem.New on
// database/sql, idempgx.New on a pgx pool.
var adapters = []string{"database/sql", "pgx"}

// forAdapters runs test once per adapter.
func forAdapters(t *testing.T, test func(t *testing.T, adapter string)) {
	for _, a := range adapters {
		t.Run(a, func(t *testing.T) {
			t.Parallel()
			test(t, a)
		})
	}
}

// setup is how a world is built: the middleware's options, the
// interceptor's, the client's dial options, and an interceptor placed
// before idem's (after the recovery one).
type setup struct {
	opts   idem.Options
	gopts  []idemgrpc.Option
	dial   []grpc.DialOption
	before grpc.UnaryServerInterceptor
	// bare leaves idem's interceptor out (the benchmarks' baseline).
	bare bool
	// table, when set, is another world's idempotency table: a second
	// server on it is another replica of the same service.
	table string
}

// world is one test's table, ledger, server and client.
type world struct {
	t       testing.TB
	adapter string
	table   string
	ledger  string
	client  testpb.LedgerClient
	pool    *pgxpool.Pool // the pgx adapter's pool
	runs    atomic.Int64
	// handle, when set, is the handler of Pay; the default is (*world).write.
	handle func(ctx context.Context, req *testpb.PayRequest) (*testpb.PayReply, error)
}

func newWorld(t testing.TB, adapter string, s setup) *world {
	t.Helper()
	n := seq.Add(1)
	w := &world{t: t, adapter: adapter, table: fmt.Sprintf("keys_%d", n), ledger: fmt.Sprintf("ledger_%d", n)}
	if s.table != "" {
		w.table = s.table
	} else {
		require.NoError(t, idem.Migrate(t.Context(), db, w.table))
	}
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)`)
	require.NoError(t, err)
	s.opts.Table = w.table
	s.opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	var mw *idem.Middleware
	if adapter == "pgx" {
		pool, err := pgxpool.New(t.Context(), dbURL)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		w.pool = pool
		mw, err = idempgx.New(pool, s.opts)
		require.NoError(t, err)
	} else {
		mw, err = idem.New(db, s.opts)
		require.NoError(t, err)
	}
	gopts := s.gopts
	if gopts == nil {
		gopts = []idemgrpc.Option{idemgrpc.WithCaller(tenant)}
	}
	chain := []grpc.UnaryServerInterceptor{recovery}
	if s.before != nil {
		chain = append(chain, s.before)
	}
	if !s.bare {
		chain = append(chain, idemgrpc.UnaryServerInterceptor(mw, gopts...))
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	testpb.RegisterLedgerServer(srv, &ledgerServer{w: w})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, s.dial...)...)
	require.NoError(t, err)
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-served
	})
	w.client = testpb.NewLedgerClient(conn)
	return w
}

// tenant is the tests' caller function: the caller is the "tenant"
// metadata entry (a real service takes it from its authentication).
func tenant(ctx context.Context) (string, error) {
	vs := metadata.ValueFromIncomingContext(ctx, "tenant")
	if len(vs) != 1 {
		return "", status.Error(codes.Unauthenticated, "no tenant")
	}
	return vs[0], nil
}

// recovery turns a panic into Internal, as a recovery interceptor does.
func recovery(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			resp, err = nil, status.Error(codes.Internal, "panic")
		}
	}()
	return handler(ctx, req)
}

type ledgerServer struct {
	testpb.UnimplementedLedgerServer
	w *world
}

func (s *ledgerServer) Pay(ctx context.Context, req *testpb.PayRequest) (*testpb.PayReply, error) {
	s.w.runs.Add(1)
	if s.w.handle != nil {
		return s.w.handle(ctx, req)
	}
	return s.w.write(ctx, req)
}

func (s *ledgerServer) Watch(req *testpb.PayRequest, stream grpc.ServerStreamingServer[testpb.PayReply]) error {
	_, inTx := idem.Tx(stream.Context())
	_, inPgx := idempgx.Tx(stream.Context())
	if inTx || inPgx {
		return status.Error(codes.Internal, "a stream ran in a transaction")
	}
	for i := range 2 {
		if err := stream.Send(&testpb.PayReply{Entry: int64(i), Account: req.Account}); err != nil {
			return err
		}
	}
	return nil
}

// write appends the payment to the ledger in idem's transaction, or
// straight to the database for a call without a key.
func (w *world) write(ctx context.Context, req *testpb.PayRequest) (*testpb.PayReply, error) {
	q := `INSERT INTO ` + w.ledger + ` (account, amount) VALUES ($1, $2) RETURNING id`
	var id int64
	var err error
	if tx, ok := idem.Tx(ctx); ok {
		err = tx.QueryRowContext(ctx, q, req.Account, req.Amount).Scan(&id)
	} else if tx, ok := idempgx.Tx(ctx); ok {
		err = tx.QueryRow(ctx, q, req.Account, req.Amount).Scan(&id)
	} else {
		err = db.QueryRowContext(ctx, q, req.Account, req.Amount).Scan(&id)
	}
	if err != nil {
		return nil, status.Error(codes.Internal, "write failed")
	}
	return &testpb.PayReply{Entry: id, Account: req.Account, Amount: req.Amount, Labels: req.Labels}, nil
}

// rows is the number of entries in the ledger.
func (w *world) rows() int {
	var n int
	require.NoError(w.t, db.QueryRow(`SELECT count(*) FROM `+w.ledger).Scan(&n))
	return n
}

// call is Pay's result, with the response header.
type call struct {
	reply  *testpb.PayReply
	header metadata.MD
	err    error
}

func (c call) replayed() bool {
	return len(c.header.Get(idemgrpc.ReplayedKey)) == 1 && c.header.Get(idemgrpc.ReplayedKey)[0] == "true"
}

// pay calls Pay with these metadata pairs (key, value, ...).
func (w *world) pay(ctx context.Context, req *testpb.PayRequest, md ...string) call {
	var c call
	ctx = metadata.NewOutgoingContext(ctx, metadata.Pairs(md...))
	c.reply, c.err = w.client.Pay(ctx, req, grpc.Header(&c.header))
	return c
}

// payKey calls Pay as tenant "acme" with key.
func (w *world) payKey(req *testpb.PayRequest, key string) call {
	ctx, cancel := context.WithTimeout(w.t.Context(), 30*time.Second)
	defer cancel()
	return w.pay(ctx, req, "tenant", "acme", idemgrpc.MetadataKey, key)
}

func req(account string, amount int64) *testpb.PayRequest {
	return &testpb.PayRequest{Account: account, Amount: amount,
		Labels: map[string]string{"a": "1", "b": "2", "c": "3", "d": "4", "e": "5", "f": "6", "g": "7", "h": "8"}}
}
