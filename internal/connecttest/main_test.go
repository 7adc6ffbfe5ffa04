package connecttest

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idempgx"
	"github.com/pgidem/idem/internal/connecttest/ledgerpb"
	"github.com/pgidem/idem/internal/connecttest/ledgerpb/ledgerpbconnect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The tests serve a Connect handler behind idem's HTTP middleware on
// loopback TCP, against PostgreSQL in a database of their own
// (DATABASE_URL, default the local server), and fail when it is missing.
var (
	db    *sql.DB
	dbURL string
)

func TestMain(m *testing.M) {
	u, drop, err := createDatabase("connecttest")
	if err != nil {
		fmt.Fprintln(os.Stderr, "connecttest: PostgreSQL is required:", err)
		os.Exit(1)
	}
	dbURL = u
	db, err = sql.Open("pgx", u)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	db.Close()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, "connecttest: drop database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "connecttest: goroutines left:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var seq atomic.Int64

// forAdapters runs test once per adapter: idem.New on database/sql,
// idempgx.New on a pgx pool.
func forAdapters(t *testing.T, test func(t *testing.T, adapter string)) {
	for _, a := range []string{"database/sql", "pgx"} {
		t.Run(a, func(t *testing.T) {
			t.Parallel()
			test(t, a)
		})
	}
}

// world is one test's idempotency table, ledger, Connect server behind the
// middleware (HTTP/1.1 and unencrypted HTTP/2 on one port) and clients.
type world struct {
	t      *testing.T
	ledger string
	url    string
	addr   string
	runs   atomic.Int64
	// fail holds the errors Pay returns, one per call, after writing its
	// row: a handler that fails after its write.
	mu   sync.Mutex
	fail []error
}

func newWorld(t *testing.T, adapter string) *world {
	t.Helper()
	n := seq.Add(1)
	w := &world{t: t, ledger: fmt.Sprintf("ledger_%d", n)}
	table := fmt.Sprintf("keys_%d", n)
	require.NoError(t, idem.Migrate(t.Context(), db, table))
	_, err := db.Exec(`CREATE TABLE ` + w.ledger + ` (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)`)
	require.NoError(t, err)
	opts := idem.Options{
		Table:   table,
		KeyFunc: procedureKey,
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	var mw *idem.Middleware
	if adapter == "pgx" {
		pool, err := pgxpool.New(t.Context(), dbURL)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		mw, err = idempgx.New(pool, opts)
		require.NoError(t, err)
	} else {
		mw, err = idem.New(db, opts)
		require.NoError(t, err)
	}
	mux := http.NewServeMux()
	path, h := ledgerpbconnect.NewLedgerHandler(&ledgerServer{w: w})
	mux.Handle(path, mw.Handler(h))
	srv := &http.Server{Handler: mux, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true) // h2c: what grpc-go's client speaks without TLS
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-served
	})
	w.addr = lis.Addr().String()
	w.url = "http://" + w.addr
	return w
}

// procedureKey is the middleware's KeyFunc: the Idempotency-Key header
// (the idempotency-key metadata entry, in gRPC), scoped by the procedure
// and the caller (here the Tenant header; a real service takes it from its
// authentication).
func procedureKey(r *http.Request, body []byte) (idem.Key, error) {
	k, err := idem.IdempotencyKey("connect")(r, body)
	if err != nil {
		return k, err
	}
	tenant := r.Header.Get("Tenant")
	if tenant == "" {
		return idem.Key{}, fmt.Errorf("%w: no tenant", idem.ErrInvalidKey)
	}
	k.Source = r.URL.Path + " " + tenant
	return k, nil
}

type ledgerServer struct {
	w *world
}

func (s *ledgerServer) Pay(ctx context.Context, req *connect.Request[ledgerpb.PayRequest]) (*connect.Response[ledgerpb.PayReply], error) {
	w := s.w
	w.runs.Add(1)
	q := `INSERT INTO ` + w.ledger + ` (account, amount) VALUES ($1, $2) RETURNING id`
	var id int64
	var err error
	if tx, ok := idem.Tx(ctx); ok {
		err = tx.QueryRowContext(ctx, q, req.Msg.Account, req.Msg.Amount).Scan(&id)
	} else if tx, ok := idempgx.Tx(ctx); ok {
		err = tx.QueryRow(ctx, q, req.Msg.Account, req.Msg.Amount).Scan(&id)
	} else {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("no idempotency transaction"))
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, errors.New("write failed"))
	}
	w.mu.Lock()
	if len(w.fail) > 0 {
		err, w.fail = w.fail[0], w.fail[1:]
	}
	w.mu.Unlock()
	if err != nil {
		return nil, err
	}
	res := connect.NewResponse(&ledgerpb.PayReply{Entry: id, Account: req.Msg.Account, Amount: req.Msg.Amount})
	res.Header().Set("Ledger-Entry", fmt.Sprint(id))
	res.Trailer().Set("Ledger-Checked", "yes")
	return res, nil
}

// failNext makes the next calls of Pay fail with these errors, after their
// write.
func (w *world) failNext(errs ...error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fail = append(w.fail, errs...)
}

// rows is the number of entries in the ledger: the effects that committed.
func (w *world) rows() int {
	var n int
	require.NoError(w.t, db.QueryRow(`SELECT count(*) FROM `+w.ledger).Scan(&n))
	return n
}

// wire records the bytes and protocol of the answers a client receives.
type wire struct {
	next http.RoundTripper
	mu   sync.Mutex
	last []byte
	prot int
}

func (rt *wire) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := rt.next.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	b, err := io.ReadAll(res.Body) // to the end: the trailers are in
	res.Body.Close()
	if err != nil {
		return nil, err
	}
	rt.mu.Lock()
	rt.last, rt.prot = b, res.ProtoMajor
	rt.mu.Unlock()
	res.Body = io.NopCloser(bytes.NewReader(b))
	return res, nil
}

// answer returns the last answer's body and HTTP major version.
func (rt *wire) answer() ([]byte, int) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.last, rt.prot
}

// httpClient is a client over HTTP/1.1 or unencrypted HTTP/2 (h2c, prior
// knowledge), recording its answers.
func httpClient(t *testing.T, h2 bool) (*http.Client, *wire) {
	tr := &http.Transport{Protocols: new(http.Protocols)}
	if h2 {
		tr.Protocols.SetUnencryptedHTTP2(true)
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	t.Cleanup(tr.CloseIdleConnections)
	rec := &wire{next: tr}
	return &http.Client{Transport: rec}, rec
}

func payRequest(key string) *connect.Request[ledgerpb.PayRequest] {
	// No map field: connect's and grpc-go's clients marshal maps in any
	// order, and the middleware's payload is the body as sent (docs/grpc.md).
	req := connect.NewRequest(&ledgerpb.PayRequest{Account: "acct-1", Amount: 500})
	req.Header().Set("Idempotency-Key", key)
	req.Header().Set("Tenant", "acme")
	return req
}
