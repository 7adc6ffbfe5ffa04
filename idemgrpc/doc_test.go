package idemgrpc_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var topLevelFunc = regexp.MustCompile(`(?m)^func `)

// TestDocCodeCompiles: the golang blocks of docs/grpc.md compile against
// this module (the root's doc test skips them: they import gRPC), with the
// test proto standing in for the reader's.
func TestDocCodeCompiles(t *testing.T) {
	text, err := os.ReadFile("../docs/grpc.md")
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	var cur *strings.Builder
	for _, line := range strings.Split(string(text), "\n") {
		switch {
		case cur == nil && strings.TrimSpace(line) == "```golang":
			cur = &strings.Builder{}
		case cur != nil && strings.TrimSpace(line) == "```":
			blocks = append(blocks, cur.String())
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
	}
	if len(blocks) < 3 {
		t.Fatalf("found %d golang blocks in docs/grpc.md; the parser is broken", len(blocks))
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"log"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemgrpc"
	pb "github.com/pgidem/idem/idemgrpc/internal/testpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

var (
	_ = log.Fatal
	_ = idem.New
	_ = idemgrpc.UnaryServerInterceptor
	_ = codes.OK
	_ = status.Error
	_ = metadata.Pairs
)

// What the snippets take from their surroundings.
var (
	db       *sql.DB
	client   pb.LedgerClient
	req      *pb.PayRequest
	recovery grpc.UnaryServerInterceptor
	callerOf func(context.Context) (string, error)
)

type server struct{ pb.UnimplementedLedgerServer }

// uuid stands in for github.com/google/uuid.
var uuid struct{ NewString func() string }

func init() {
	uuid.NewString = func() string { var b [16]byte; _, _ = rand.Read(b[:]); return hex.EncodeToString(b[:]) }
}
`)
	for i, code := range blocks {
		if topLevelFunc.MatchString(code) {
			b.WriteString(code)
		} else {
			fmt.Fprintf(&b, "func block%d(ctx context.Context) error {\n%s\treturn nil\n}\n", i, code)
		}
	}
	dir, err := os.MkdirTemp(".", ".doccode-") // inside the module; ./... skips dot directories
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.WriteFile(filepath.Join(dir, "doc.go"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("go", "vet", "./"+filepath.Base(dir)).CombinedOutput(); err != nil {
		t.Fatalf("the Go blocks of docs/grpc.md do not compile:\n%s\n%s", out, b.String())
	}
}
