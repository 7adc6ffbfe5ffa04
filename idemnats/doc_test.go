package idemnats_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocCodeCompiles: the golang blocks of docs/nats.md compile against
// this module (the root's doc test skips them: they import NATS).
func TestDocCodeCompiles(t *testing.T) {
	t.Parallel()
	text, err := os.ReadFile("../docs/nats.md")
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
	if len(blocks) < 1 {
		t.Fatal("found no golang block in docs/nats.md; the parser is broken")
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"database/sql"
	"log"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
)

var (
	_ = log.Fatal
	_ = idem.New
	_ = idemnats.New
	_ = time.Second
)

// What the snippets take from their surroundings.
var (
	db *sql.DB
	js jetstream.JetStream
)
`)
	topLevelFunc := regexp.MustCompile(`(?m)^func `)
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
		t.Fatalf("the Go blocks of docs/nats.md do not compile:\n%s\n%s", out, b.String())
	}
}
