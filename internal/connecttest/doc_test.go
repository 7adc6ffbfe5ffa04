package connecttest

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

// TestConnectDocCodeCompiles: the "go connect" blocks of docs/grpc.md (its
// Connect section) compile against this module, with the test service
// standing in for the reader's. (The root's doc test compiles the plain
// "go" blocks, idemgrpc's the "golang" ones.)
func TestConnectDocCodeCompiles(t *testing.T) {
	text, err := os.ReadFile("../../docs/grpc.md")
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	var cur *strings.Builder
	for line := range strings.SplitSeq(string(text), "\n") {
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go connect":
			cur = &strings.Builder{}
		case cur != nil && strings.TrimSpace(line) == "```":
			blocks = append(blocks, cur.String())
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
	}
	if len(blocks) < 2 {
		t.Fatalf("found %d go connect blocks in docs/grpc.md; the parser is broken", len(blocks))
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"net/http"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/connecttest/ledgerpb/ledgerpbconnect"
)

var (
	_ = log.Fatal
	_ = fmt.Errorf
	_ = idem.New
)

// What the snippets take from their surroundings.
var (
	db       *sql.DB
	callerOf func(context.Context) (string, bool)
)

type server struct{ ledgerpbconnect.UnimplementedLedgerHandler }
`)
	for i, code := range blocks {
		if topLevelFunc.MatchString(code) {
			b.WriteString(code)
		} else {
			fmt.Fprintf(&b, "func block%d() {\n%s}\n", i, code)
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
		t.Fatalf("the go connect blocks of docs/grpc.md do not compile:\n%s\n%s", out, b.String())
	}
}
