// Package connecttest checks idem's HTTP middleware in front of a Connect
// handler (connectrpc.com/connect), over HTTP/1.1 and HTTP/2, with the
// three protocols such a handler serves: Connect (with connect's client),
// gRPC (with grpc-go's client) and gRPC-Web (with connect's client). It is
// a module of its own, for tests only, so that no published module of idem
// requires connect. The test service's generated code is in ledgerpb (see
// its generate.go).
package connecttest
