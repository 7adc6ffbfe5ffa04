// Command idemgrpc calls idemgrpc's interceptor with a malformed key, which
// it refuses with InvalidArgument before any claim.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

func main() {
	mw, err := idem.New(offlineDB(), options())
	check(err)
	intercept := idemgrpc.UnaryServerInterceptor(mw, idemgrpc.SingleTenant())
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idemgrpc.MetadataKey, "not a token"))
	_, err = intercept(ctx, &emptypb.Empty{}, &grpc.UnaryServerInfo{FullMethod: "/rehearsal.V1/Call"},
		func(context.Context, any) (any, error) { return &emptypb.Empty{}, nil })
	fmt.Println("idemgrpc:", status.Code(err))
	if status.Code(err) != codes.InvalidArgument {
		os.Exit(1)
	}
}
