package idemgrpc_test

import (
	"context"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"github.com/pgidem/idem/idemgrpc/internal/testpb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

func wire(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	require.NoError(t, err)
	return b
}

func TestARetryGetsTheStoredResponseAndTheHandlerRunsOnce(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		first := w.payKey(req("alice", 10), "k1")
		require.NoError(t, first.err)
		assert.False(t, first.replayed(), "the first call is no replay")

		// The same message, built anew: its map field's order differs in
		// memory, not in the deterministic digest.
		again := w.payKey(req("alice", 10), "k1")
		require.NoError(t, again.err)
		assert.True(t, again.replayed(), "the retry is marked idempotent-replayed: true")
		assert.Equal(t, wire(t, first.reply), wire(t, again.reply), "the replay is byte-identical")
		assert.True(t, proto.Equal(first.reply, again.reply))
		assert.EqualValues(t, 1, w.runs.Load(), "the handler ran once")
		assert.Equal(t, 1, w.rows())

		// The quoted form of the same key is the same key, as for HTTP.
		quoted := w.payKey(req("alice", 10), `"k1"`)
		require.NoError(t, quoted.err)
		assert.True(t, quoted.replayed())
		assert.EqualValues(t, 1, w.runs.Load())
	})
}

// wireCodec is the proto codec, keeping the last response's bytes as
// they came over the wire.
type wireCodec struct{ last []byte }

func (c *wireCodec) Marshal(v any) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (c *wireCodec) Unmarshal(data []byte, v any) error {
	c.last = append([]byte(nil), data...)
	return proto.Unmarshal(data, v.(proto.Message))
}
func (*wireCodec) Name() string { return "proto" }

func TestTheReplayIsByteIdenticalOnTheWire(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		ctx := metadata.NewOutgoingContext(t.Context(), metadata.Pairs("tenant", "acme", idemgrpc.MetadataKey, "wire"))
		var got [2][]byte
		for i := range got {
			codec := &wireCodec{}
			var header metadata.MD
			// No map field: a map's entries go on the wire in any order.
			_, err := w.client.Pay(ctx, &testpb.PayRequest{Account: "wire", Amount: 12345}, grpc.ForceCodec(codec), grpc.Header(&header))
			require.NoError(t, err)
			assert.Equal(t, i == 1, len(header.Get(idemgrpc.ReplayedKey)) == 1)
			got[i] = codec.last
		}
		require.NotEmpty(t, got[0])
		assert.Equal(t, got[0], got[1], "the replay's bytes on the wire are the first response's")
		assert.EqualValues(t, 1, w.runs.Load())
	})
}

func TestConcurrentRetriesHaveOneEffect(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		const n = 8
		var wg sync.WaitGroup
		start := make(chan struct{})
		calls := make([]call, n)
		for i := range n {
			wg.Go(func() {
				<-start
				calls[i] = w.payKey(req("bob", 5), "same")
			})
		}
		close(start)
		wg.Wait()
		replays := 0
		for _, c := range calls {
			require.NoError(t, c.err)
			assert.Equal(t, wire(t, calls[0].reply), wire(t, c.reply))
			if c.replayed() {
				replays++
			}
		}
		assert.Equal(t, n-1, replays, "all but one are replays")
		assert.EqualValues(t, 1, w.runs.Load())
		assert.Equal(t, 1, w.rows())
	})
}

func TestAKeyInFlightIsAbortedWithRetryInfoThenReplayed(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{opts: idem.Options{LockWait: -1}, gopts: []idemgrpc.Option{
			idemgrpc.WithCaller(tenant), idemgrpc.WithRetryDelay(250 * time.Millisecond)}})
		entered, release, done := w.held()
		go func() { done <- w.payKey(req("carol", 1), "slow") }()
		<-entered
		dup := w.payKey(req("carol", 1), "slow")
		assert.Equal(t, 250*time.Millisecond, abortedDelay(t, dup.err))

		close(release)
		orig := <-done
		require.NoError(t, orig.err)
		retry := w.payKey(req("carol", 1), "slow")
		require.NoError(t, retry.err)
		assert.True(t, retry.replayed())
		assert.Equal(t, wire(t, orig.reply), wire(t, retry.reply))
		assert.EqualValues(t, 1, w.runs.Load())
	})
}

// held makes w's handler wait, once entered, until release is closed; the
// test sends the original's result on done.
func (w *world) held() (entered, release chan struct{}, done chan call) {
	entered, release, done = make(chan struct{}), make(chan struct{}), make(chan call)
	w.handle = func(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
		close(entered)
		<-release
		return w.write(ctx, r)
	}
	return entered, release, done
}

// abortedDelay checks that err is Aborted with RetryInfo and returns its
// delay.
func abortedDelay(t *testing.T, err error) time.Duration {
	t.Helper()
	st := status.Convert(err)
	require.Equal(t, codes.Aborted, st.Code(), "%v", err)
	require.Len(t, st.Details(), 1)
	ri, ok := st.Details()[0].(*errdetails.RetryInfo)
	require.True(t, ok)
	return ri.RetryDelay.AsDuration()
}

// In lease mode (Options.Lease) the claim commits at once and the handler
// runs without holding a connection; its writes still go through idem.Tx
// and commit with the response. A duplicate at another replica while the
// lease runs is Aborted at once, with the lease's time left as its retry
// delay, and the retry after the original gets its response. (On the
// original's own replica a duplicate waits for it in memory, LockWait at
// most, as in single-transaction mode.)
func TestLeaseModeThroughTheInterceptor(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		const lease = 20 * time.Second
		w := newWorld(t, adapter, setup{opts: idem.Options{Lease: lease, HandlerTimeout: 15 * time.Second}})
		replica := newWorld(t, adapter, setup{opts: idem.Options{Lease: lease, HandlerTimeout: 15 * time.Second}, table: w.table})
		entered, release, done := w.held()
		go func() { done <- w.payKey(req("dave", 1), "leased") }()
		<-entered
		var claimed int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+w.table).Scan(&claimed))
		assert.Equal(t, 1, claimed, "the claim committed before the handler ran: lease mode")

		dup := replica.payKey(req("dave", 1), "leased")
		delay := abortedDelay(t, dup.err)
		assert.Greater(t, delay, idemgrpc.DefaultRetryDelay, "the lease's time left, not the default")
		assert.LessOrEqual(t, delay, lease)

		close(release)
		orig := <-done
		require.NoError(t, orig.err)
		for _, at := range []*world{w, replica} {
			retry := at.payKey(req("dave", 1), "leased")
			require.NoError(t, retry.err)
			assert.True(t, retry.replayed())
			assert.Equal(t, wire(t, orig.reply), wire(t, retry.reply))
		}
		assert.EqualValues(t, 1, w.runs.Load()+replica.runs.Load())
		assert.Equal(t, 1, w.rows(), "the handler's write committed once, with the response")
	})
}

func TestAnotherMessageUnderTheSameKeyIsAFailedPrecondition(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		require.NoError(t, w.payKey(req("dave", 1), "k").err)
		other := w.payKey(req("dave", 2), "k")
		assert.Equal(t, codes.FailedPrecondition, status.Code(other.err), "%v", other.err)
		assert.EqualValues(t, 1, w.runs.Load())
		assert.Equal(t, 1, w.rows())
	})
}

func TestAHandlerErrorIsNotStoredAndTheRetryRunsAgain(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		var fail atomic.Bool
		fail.Store(true)
		w.handle = func(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
			if _, err := w.write(ctx, r); err != nil {
				return nil, err
			}
			if fail.Load() {
				return nil, status.Error(codes.Unavailable, "the bank is down")
			}
			return w.write(ctx, r)
		}
		first := w.payKey(req("erin", 3), "k")
		st := status.Convert(first.err)
		assert.Equal(t, codes.Unavailable, st.Code())
		assert.Equal(t, "the bank is down", st.Message(), "the handler's own status reaches the client")
		assert.Equal(t, 0, w.rows(), "its write rolled back")

		fail.Store(false)
		retry := w.payKey(req("erin", 3), "k")
		require.NoError(t, retry.err)
		assert.False(t, retry.replayed())
		assert.EqualValues(t, 2, w.runs.Load())
		assert.Equal(t, 2, w.rows(), "the retry's two writes committed")
	})
}

func TestAFinalCodeIsStoredAndReplayed(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{gopts: []idemgrpc.Option{idemgrpc.WithCaller(tenant), idemgrpc.WithFinalCodes(codes.FailedPrecondition)}})
		w.handle = func(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
			if _, err := w.write(ctx, r); err != nil { // an audit row, committed with the refusal
				return nil, err
			}
			st, _ := status.New(codes.FailedPrecondition, "insufficient funds").WithDetails(&errdetails.ErrorInfo{Reason: "FUNDS"})
			return nil, st.Err()
		}
		first := w.payKey(req("frank", 100), "k")
		again := w.payKey(req("frank", 100), "k")
		for _, c := range []call{first, again} {
			st := status.Convert(c.err)
			assert.Equal(t, codes.FailedPrecondition, st.Code())
			assert.Equal(t, "insufficient funds", st.Message())
			require.Len(t, st.Details(), 1)
			assert.Equal(t, "FUNDS", st.Details()[0].(*errdetails.ErrorInfo).Reason)
		}
		assert.False(t, first.replayed())
		assert.True(t, again.replayed())
		assert.EqualValues(t, 1, w.runs.Load())
		assert.Equal(t, 1, w.rows())
	})
}

func TestAPanicRollsBackUnderARecoveryInterceptor(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		var panicked atomic.Bool
		w.handle = func(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
			if _, err := w.write(ctx, r); err != nil {
				return nil, err
			}
			if panicked.CompareAndSwap(false, true) {
				panic("boom")
			}
			return &testpb.PayReply{Account: r.Account}, nil
		}
		first := w.payKey(req("gina", 1), "k")
		assert.Equal(t, codes.Internal, status.Code(first.err))
		assert.Equal(t, 0, w.rows())
		retry := w.payKey(req("gina", 1), "k")
		require.NoError(t, retry.err)
		assert.False(t, retry.replayed())
		assert.Equal(t, 1, w.rows())
	})
}

func TestKeysMissingOrMalformed(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		ctx := t.Context()

		t.Run("a call without a key passes through, outside a transaction", func(t *testing.T) {
			for range 2 {
				require.NoError(t, w.pay(ctx, req("h", 1), "tenant", "acme").err)
			}
			assert.Equal(t, 2, w.rows())
		})
		for _, tc := range []struct{ name, key string }{
			{"a key with a space", "zq zq"},
			{"a key with a comma", "zq,zq"},
			{"an unterminated quoted key", `"abc`},
			{"a key longer than 255 bytes", strings.Repeat("k", 256)},
		} {
			t.Run(tc.name+" is InvalidArgument", func(t *testing.T) {
				c := w.payKey(req("h", 1), tc.key)
				st := status.Convert(c.err)
				assert.Equal(t, codes.InvalidArgument, st.Code(), "%v", c.err)
				assert.NotContains(t, st.Message(), tc.key)
			})
		}
		t.Run("a key sent twice is InvalidArgument", func(t *testing.T) {
			c := w.pay(ctx, req("h", 1), "tenant", "acme", idemgrpc.MetadataKey, "a", idemgrpc.MetadataKey, "b")
			assert.Equal(t, codes.InvalidArgument, status.Code(c.err))
		})
		t.Run("a key without a caller is Unauthenticated", func(t *testing.T) {
			c := w.pay(ctx, req("h", 1), idemgrpc.MetadataKey, "k")
			assert.Equal(t, codes.Unauthenticated, status.Code(c.err))
		})
		assert.EqualValues(t, 2, w.runs.Load(), "only the calls without a key ran")

		t.Run("RequireKey refuses a call without one", func(t *testing.T) {
			strict := newWorld(t, adapter, setup{gopts: []idemgrpc.Option{idemgrpc.SingleTenant(), idemgrpc.RequireKey()}})
			c := strict.pay(ctx, req("h", 1))
			assert.Equal(t, codes.InvalidArgument, status.Code(c.err))
			assert.Contains(t, status.Convert(c.err).Message(), "idempotency-key metadata entry")
			assert.EqualValues(t, 0, strict.runs.Load())
		})
		t.Run("RequireKey with WithKeyField names the field", func(t *testing.T) {
			strict := newWorld(t, adapter, setup{gopts: []idemgrpc.Option{idemgrpc.SingleTenant(), idemgrpc.RequireKey(), idemgrpc.WithKeyField("request_id")}})
			c := strict.pay(ctx, req("h", 1), idemgrpc.MetadataKey, "ignored")
			assert.Equal(t, codes.InvalidArgument, status.Code(c.err))
			assert.Contains(t, status.Convert(c.err).Message(), "request_id field")
			assert.EqualValues(t, 0, strict.runs.Load())
		})
	})
}

func TestCallersAreScopedApart(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		ctx := t.Context()
		a := w.pay(ctx, req("i", 1), "tenant", "a", idemgrpc.MetadataKey, "k")
		b := w.pay(ctx, req("i", 1), "tenant", "b", idemgrpc.MetadataKey, "k")
		require.NoError(t, a.err)
		require.NoError(t, b.err)
		assert.False(t, b.replayed(), "another caller's key is another key")
		assert.NotEqual(t, a.reply.Entry, b.reply.Entry)
		assert.Equal(t, 2, w.rows())
	})
}

func TestTheKeyFromTheRequestMessage(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{gopts: []idemgrpc.Option{idemgrpc.SingleTenant(), idemgrpc.WithKeyField("request_id")}})
		ctx := t.Context()
		r := req("j", 7)
		r.RequestId = "3f1c0f6e-8d9b-4a51-b8f7-1b0f3c9d2e11"
		first := w.pay(ctx, r)
		again := w.pay(ctx, r)
		require.NoError(t, first.err)
		require.NoError(t, again.err)
		assert.True(t, again.replayed())
		assert.EqualValues(t, 1, w.runs.Load())
		require.NoError(t, w.pay(ctx, req("j", 7)).err, "no request_id: passes through")
		assert.Equal(t, 2, w.rows())
	})
}

func TestAClientDeadlineShorterThanTheHandler(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		entered, release, finished := make(chan struct{}), make(chan struct{}), make(chan struct{})
		w.handle = func(ctx context.Context, r *testpb.PayRequest) (*testpb.PayReply, error) {
			defer close(finished)
			close(entered)
			<-release
			if ctx.Err() != nil {
				return nil, ctx.Err() // the work would be lost: the test fails below
			}
			return w.write(ctx, r)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		first := w.pay(ctx, req("kim", 9), "tenant", "acme", idemgrpc.MetadataKey, "k")
		assert.Equal(t, codes.DeadlineExceeded, status.Code(first.err))
		<-entered
		close(release) // the handler goes on after its client gave up
		<-finished

		// The retry waits for the original (LockWait) if it is still
		// committing, then gets its answer.
		var retry call
		for {
			retry = w.payKey(req("kim", 9), "k")
			if status.Code(retry.err) != codes.Aborted {
				break
			}
		}
		require.NoError(t, retry.err)
		assert.True(t, retry.replayed())
		assert.EqualValues(t, 1, w.runs.Load())
		assert.Equal(t, 1, w.rows(), "the work committed once")
	})
}

// TestGRPCRetryPolicyEndToEnd: grpc-go's own retry policy, from the
// client's service config, resends the call with its metadata after the
// first answer is lost (an interceptor before idem drops it and answers
// Unavailable): the second attempt is a replay, and the handler ran once.
func TestGRPCRetryPolicyEndToEnd(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		var attempts atomic.Int64
		lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			resp, err := handler(ctx, req)
			if attempts.Add(1) == 1 && err == nil {
				return nil, status.Error(codes.Unavailable, "the answer was lost on the way")
			}
			return resp, err
		}
		w := newWorld(t, adapter, setup{before: lose, dial: []grpc.DialOption{grpc.WithDefaultServiceConfig(`{
			"methodConfig": [{
				"name": [{"service": "idemgrpc.test.Ledger", "method": "Pay"}],
				"retryPolicy": {
					"maxAttempts": 3,
					"initialBackoff": "0.01s",
					"maxBackoff": "0.05s",
					"backoffMultiplier": 2,
					"retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
				}
			}]}`)}})
		c := w.payKey(req("lee", 4), "k")
		require.NoError(t, c.err)
		assert.True(t, c.replayed(), "the client's second attempt got the stored answer")
		assert.EqualValues(t, 2, attempts.Load())
		assert.EqualValues(t, 1, w.runs.Load())
		assert.Equal(t, 1, w.rows())
	})
}

func TestStreamsPassThrough(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter, setup{})
		ctx := metadata.NewOutgoingContext(t.Context(), metadata.Pairs("tenant", "acme", idemgrpc.MetadataKey, "k"))
		for range 2 {
			s, err := w.client.Watch(ctx, req("m", 1))
			require.NoError(t, err)
			n := 0
			for {
				_, err := s.Recv()
				if err != nil {
					require.ErrorIs(t, err, io.EOF)
					break
				}
				n++
			}
			assert.Equal(t, 2, n)
		}
	})
}

func TestTheInterceptorRefusesAMissingScope(t *testing.T) {
	mw, err := idem.New(db, idem.Options{})
	require.NoError(t, err)
	assert.PanicsWithValue(t, "idemgrpc: UnaryServerInterceptor needs WithCaller, or SingleTenant when all callers share one scope", func() {
		idemgrpc.UnaryServerInterceptor(mw)
	})
	assert.Panics(t, func() { idemgrpc.UnaryServerInterceptor(mw, idemgrpc.SingleTenant(), idemgrpc.WithCaller(tenant)) })
}
