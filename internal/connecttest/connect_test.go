package connecttest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/pgidem/idem/internal/connecttest/ledgerpb"
	"github.com/pgidem/idem/internal/connecttest/ledgerpb/ledgerpbconnect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// connect's client, in the Connect protocol and in gRPC-Web, over HTTP/1.1
// and HTTP/2: a retried call has one effect and gets the first answer's
// bytes; a call answered with an error is not stored, and its retry runs
// the handler again.
func TestConnectClientRetries(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter)
		for _, c := range []struct {
			name string
			h2   bool
			opts []connect.ClientOption
		}{
			{"Connect over HTTP/1.1", false, nil},
			{"Connect over HTTP/2", true, nil},
			{"gRPC-Web over HTTP/1.1", false, []connect.ClientOption{connect.WithGRPCWeb()}},
			{"gRPC-Web over HTTP/2", true, []connect.ClientOption{connect.WithGRPCWeb()}},
		} {
			t.Run(c.name, func(t *testing.T) {
				hc, rec := httpClient(t, c.h2)
				client := ledgerpbconnect.NewLedgerClient(hc, w.url, c.opts...)
				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				wantProto := map[bool]int{false: 1, true: 2}[c.h2]

				t.Run("a retry gets the same bytes and the handler ran once", func(t *testing.T) {
					key := fmt.Sprintf("ok-%d", seq.Add(1))
					rows, runs := w.rows(), w.runs.Load()
					first, err := client.Pay(ctx, payRequest(key))
					require.NoError(t, err)
					firstBytes, prot := rec.answer()
					require.Equal(t, wantProto, prot)
					assert.Empty(t, first.Header().Get("Idempotent-Replayed"))

					retry, err := client.Pay(ctx, payRequest(key))
					require.NoError(t, err)
					retryBytes, _ := rec.answer()
					assert.Equal(t, firstBytes, retryBytes, "the same bytes on the wire")
					assert.True(t, proto.Equal(first.Msg, retry.Msg))
					assert.Equal(t, "true", retry.Header().Get("Idempotent-Replayed"))
					assert.Equal(t, rows+1, w.rows(), "one effect")
					assert.Equal(t, runs+1, w.runs.Load(), "the retry did not run the handler")
					if c.opts != nil { // gRPC-Web: the trailers are in the replayed body
						assert.Equal(t, "yes", retry.Trailer().Get("Ledger-Checked"))
					}
				})

				t.Run("an error is not stored: the retry runs again", func(t *testing.T) {
					key := fmt.Sprintf("err-%d", seq.Add(1))
					rows, runs := w.rows(), w.runs.Load()
					w.failNext(connect.NewError(connect.CodeUnavailable, errors.New("ledger busy")))
					_, err := client.Pay(ctx, payRequest(key))
					require.Error(t, err)
					assert.Equal(t, connect.CodeUnavailable, connect.CodeOf(err))
					assert.Equal(t, rows, w.rows(), "the failed call's write rolled back")

					retry, err := client.Pay(ctx, payRequest(key))
					require.NoError(t, err)
					assert.Empty(t, retry.Header().Get("Idempotent-Replayed"))
					again, err := client.Pay(ctx, payRequest(key))
					require.NoError(t, err)
					assert.Equal(t, "true", again.Header().Get("Idempotent-Replayed"))
					assert.True(t, proto.Equal(retry.Msg, again.Msg))
					assert.Equal(t, rows+1, w.rows(), "one effect")
					assert.Equal(t, runs+2, w.runs.Load(), "the failed call, then its retry")
				})
			})
		}
	})
}

// grpc-go's client, over HTTP/2 without TLS, calls the Connect handler in
// the gRPC protocol: a success is stored and replayed with its trailers
// (grpc-status 0 and the handler's own); an error travels as 200 with a
// grpc-status trailer, is not stored, and its retry runs the handler again.
func TestGRPCClientRetries(t *testing.T) {
	forAdapters(t, func(t *testing.T, adapter string) {
		w := newWorld(t, adapter)
		conn, err := grpc.NewClient(w.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		client := ledgerpb.NewLedgerClient(conn)
		pay := func(key string) (*ledgerpb.PayReply, metadata.MD, metadata.MD, error) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", key, "tenant", "acme")
			var header, trailer metadata.MD
			reply, err := client.Pay(ctx, &ledgerpb.PayRequest{Account: "acct-1", Amount: 500}, grpc.Header(&header), grpc.Trailer(&trailer))
			return reply, header, trailer, err
		}

		t.Run("a retry gets the same message with its trailers", func(t *testing.T) {
			key := fmt.Sprintf("grpc-ok-%d", seq.Add(1))
			rows, runs := w.rows(), w.runs.Load()
			first, header, trailer, err := pay(key)
			require.NoError(t, err)
			assert.Empty(t, header.Get("idempotent-replayed"))
			assert.Equal(t, []string{"yes"}, trailer.Get("ledger-checked"))

			retry, header, trailer, err := pay(key)
			require.NoError(t, err, "a replay without its grpc-status trailer would fail here")
			assert.Equal(t, []string{"true"}, header.Get("idempotent-replayed"))
			assert.Equal(t, []string{"yes"}, trailer.Get("ledger-checked"), "the handler's trailer, replayed")
			want, _ := proto.MarshalOptions{Deterministic: true}.Marshal(first)
			got, _ := proto.MarshalOptions{Deterministic: true}.Marshal(retry)
			assert.Equal(t, want, got)
			assert.Equal(t, rows+1, w.rows(), "one effect")
			assert.Equal(t, runs+1, w.runs.Load(), "the retry did not run the handler")
		})

		t.Run("an error is not stored: the retry runs again", func(t *testing.T) {
			key := fmt.Sprintf("grpc-err-%d", seq.Add(1))
			rows, runs := w.rows(), w.runs.Load()
			w.failNext(connect.NewError(connect.CodeAborted, errors.New("ledger busy")))
			_, _, _, err := pay(key)
			require.Error(t, err)
			st := status.Convert(err)
			assert.Equal(t, codes.Aborted, st.Code())
			assert.Equal(t, "ledger busy", st.Message())
			assert.Equal(t, rows, w.rows(), "the failed call's write rolled back")

			retry, header, _, err := pay(key)
			require.NoError(t, err)
			assert.Empty(t, header.Get("idempotent-replayed"))
			again, header, _, err := pay(key)
			require.NoError(t, err)
			assert.Equal(t, []string{"true"}, header.Get("idempotent-replayed"))
			assert.Equal(t, retry.Entry, again.Entry)
			assert.Equal(t, rows+1, w.rows(), "one effect")
			assert.Equal(t, runs+2, w.runs.Load(), "the failed call, then its retry")
		})
	})
}
