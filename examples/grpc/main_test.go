package main

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/pgidem/idem/examples/grpc/paymentspb"
	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestGRPC(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	srv, err := setup(context.Background(), db)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(retries))
	require.NoError(t, err)
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		<-served
	})
	client := paymentspb.NewPaymentsClient(conn)
	ctx := t.Context()
	rows := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM payments`) }

	t.Run("a retry with the same key gets the same reply and records nothing", func(t *testing.T) {
		req := &paymentspb.PayRequest{Account: "acme", AmountCents: 1000}
		first, replayed, err := pay(ctx, client, "order-1", req)
		require.NoError(t, err)
		assert.False(t, replayed)
		for range 3 {
			again, replayed, err := pay(ctx, client, "order-1", req)
			require.NoError(t, err)
			assert.True(t, replayed)
			assert.True(t, proto.Equal(first, again))
		}
		assert.Equal(t, 1, rows())
	})

	t.Run("another payment under the same key is refused", func(t *testing.T) {
		_, _, err := pay(ctx, client, "order-1", &paymentspb.PayRequest{Account: "acme", AmountCents: 2000})
		assert.Equal(t, codes.FailedPrecondition, status.Code(err))
	})

	t.Run("a call without a key is refused", func(t *testing.T) {
		_, err := client.Pay(ctx, &paymentspb.PayRequest{Account: "acme", AmountCents: 1})
		assert.Equal(t, codes.InvalidArgument, status.Code(err))
	})

	t.Run("a refused payment is not stored: its retry runs again", func(t *testing.T) {
		for range 2 {
			_, replayed, err := pay(ctx, client, "order-2", &paymentspb.PayRequest{Account: "acme"})
			assert.Equal(t, codes.InvalidArgument, status.Code(err))
			assert.False(t, replayed)
		}
	})
	assert.Equal(t, 1, rows())
}
