// Package ledgerpb is the generated code of internal/connecttest's test
// service: the messages (protoc-gen-go), the Connect handler and client
// (ledgerpbconnect, protoc-gen-connect-go) and the grpc-go client
// (protoc-gen-go-grpc). Regenerate it with go generate (needs protoc,
// protoc-gen-go v1.36.12, protoc-gen-connect-go v1.21.1 and
// protoc-gen-go-grpc v1.6.2 on PATH).
package ledgerpb

//go:generate protoc --go_out=. --go_opt=paths=source_relative --connect-go_out=. --connect-go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative ledger.proto
