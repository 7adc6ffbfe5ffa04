// Command grpc serves a Payments gRPC service whose Pay records each
// payment exactly once, through idemgrpc: a retried call with the same
// idempotency key gets the first reply, and records nothing.
//
//	go run ./grpc                       # serves on 127.0.0.1:50051
//	go run ./grpc -pay order-1          # calls Pay with the key order-1
//	go run ./grpc -pay order-1          # the same reply, replayed
//
// The generated code is in paymentspb (go generate ./grpc/paymentspb
// regenerates it).
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/grpc/paymentspb"
	"github.com/pgidem/idem/examples/internal/example"
	"github.com/pgidem/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "address to serve on, or to call")
	dsn := flag.String("database-url", "", example.DatabaseURLUsage)
	pay := flag.String("pay", "", "call Pay with this idempotency key instead of serving")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if *pay != "" {
		err = call(ctx, *addr, *pay)
	} else {
		err = serve(ctx, *addr, *dsn)
	}
	if err != nil {
		log.Fatal(example.OneLine(err))
	}
}

// serve runs the service on addr until ctx ends.
func serve(ctx context.Context, addr, dsn string) error {
	if dsn == "" {
		dsn = example.DatabaseURL()
	}
	db, err := example.OpenDB(ctx, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	srv, err := setup(ctx, db)
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	log.Printf("serving Payments on %s", lis.Addr())
	return srv.Serve(lis)
}

// setup creates the tables and returns the server, not yet serving.
func setup(ctx context.Context, db *sql.DB) (*grpc.Server, error) {
	if err := idem.Migrate(ctx, db, ""); err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS payments (
		id           bigserial PRIMARY KEY,
		account      text      NOT NULL,
		amount_cents bigint    NOT NULL)`); err != nil {
		return nil, err
	}
	mw, err := idem.New(db, idem.Options{}) // Do only: no KeyFunc
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		recovery,
		// One client in this example; a service with several scopes keys
		// by caller with idemgrpc.WithCaller.
		idemgrpc.UnaryServerInterceptor(mw, idemgrpc.SingleTenant(), idemgrpc.RequireKey()),
	))
	paymentspb.RegisterPaymentsServer(srv, payments{})
	return srv, nil
}

// payments is the service.
type payments struct {
	paymentspb.UnimplementedPaymentsServer
}

// Pay records the payment in idem's transaction: it commits with the
// stored reply, once per key.
func (payments) Pay(ctx context.Context, req *paymentspb.PayRequest) (*paymentspb.PayReply, error) {
	if req.AmountCents <= 0 {
		return nil, status.Error(codes.InvalidArgument, "amount_cents must be positive")
	}
	tx, ok := idem.Tx(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "not in idem's transaction")
	}
	var id int64
	err := tx.QueryRowContext(ctx, `INSERT INTO payments (account, amount_cents) VALUES ($1, $2) RETURNING id`,
		req.Account, req.AmountCents).Scan(&id)
	if err != nil {
		log.Printf("pay: %v", err)
		return nil, status.Error(codes.Internal, "payment not recorded") // rolled back: a retry runs again
	}
	return &paymentspb.PayReply{PaymentId: id, Account: req.Account, AmountCents: req.AmountCents}, nil
}

// recovery answers Internal for a panic, after idem has rolled back.
func recovery(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			log.Printf("panic: %v", p)
			resp, err = nil, status.Error(codes.Internal, "internal error")
		}
	}()
	return handler(ctx, req)
}

// retries is the client's service config: grpc-go retries Pay on
// UNAVAILABLE and ABORTED, resending the same idempotency key.
const retries = `{"methodConfig": [{
	"name": [{"service": "payments.v1.Payments"}],
	"retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
		"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}}]}`

// call pays 1000 cents into account "acme" with key, and prints the reply.
func call(ctx context.Context, addr, key string) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(retries))
	if err != nil {
		return err
	}
	defer conn.Close()
	reply, replayed, err := pay(ctx, paymentspb.NewPaymentsClient(conn), key, &paymentspb.PayRequest{Account: "acme", AmountCents: 1000})
	if err != nil {
		return errors.Join(errors.New("Pay failed"), err)
	}
	fmt.Printf("payment %d: %d cents to %s (replayed: %v)\n", reply.PaymentId, reply.AmountCents, reply.Account, replayed)
	return nil
}

// pay calls Pay with key, and reports whether the reply was replayed.
func pay(ctx context.Context, c paymentspb.PaymentsClient, key string, req *paymentspb.PayRequest) (*paymentspb.PayReply, bool, error) {
	ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, key)
	var header metadata.MD
	reply, err := c.Pay(ctx, req, grpc.Header(&header))
	replayed := len(header.Get(idemgrpc.ReplayedKey)) > 0 && header.Get(idemgrpc.ReplayedKey)[0] == "true"
	return reply, replayed, err
}
