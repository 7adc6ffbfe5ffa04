package idemrabbitmq_test

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

// TestDocCodeCompiles: the golang blocks of docs/rabbitmq.md compile
// against this module (the root's doc test skips them: they import
// amqp091-go).
func TestDocCodeCompiles(t *testing.T) {
	t.Parallel()
	text, err := os.ReadFile("../docs/rabbitmq.md")
	if err != nil {
		t.Fatal(err)
	}
	var blocks []string
	var cur *strings.Builder
	for line := range strings.SplitSeq(string(text), "\n") {
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
		t.Fatalf("found %d golang blocks in docs/rabbitmq.md; the parser is broken", len(blocks))
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"database/sql"
	"errors"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	_ = errors.New
	_ = idem.New
	_ = idemrabbitmq.New
)

// What the snippets take from their surroundings.
var (
	db   *sql.DB
	ch   *amqp.Channel
	args amqp.Table
)

`)
	for i, code := range blocks {
		lines := strings.Split(strings.TrimSpace(code), "\n")
		switch {
		case topLevelFunc.MatchString(code):
			b.WriteString(code)
		case strings.HasPrefix(lines[len(lines)-1], "return "): // the block ends the function
			fmt.Fprintf(&b, "func block%d(ctx context.Context) error {\n%s}\n", i, code)
		default:
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
	if out, err := exec.Command("go", "build", "-o", os.DevNull, "./"+filepath.Base(dir)).CombinedOutput(); err != nil {
		t.Fatalf("the Go blocks of docs/rabbitmq.md do not compile:\n%s\n%s", out, b.String())
	}
}
