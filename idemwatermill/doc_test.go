package idemwatermill_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var topLevelDecl = regexp.MustCompile(`(?m)^(func|type) `)

// TestDocCodeCompiles: the golang blocks of docs/watermill.md compile
// against this module (the root's doc test skips them: they import
// Watermill).
func TestDocCodeCompiles(t *testing.T) {
	text, err := os.ReadFile("../docs/watermill.md")
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
	if len(blocks) < 4 {
		t.Fatalf("found %d golang blocks in docs/watermill.md; the parser is broken", len(blocks))
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemwatermill"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

var (
	_ = errors.New
	_ = fmt.Sprint
	_ = log.Fatal
	_ = watermill.NewUUID
	_ = amqp.NewDurableQueueConfig
	_ = middleware.PoisonQueue
	_ = idem.New
	_ = idemwatermill.Middleware
	_ = amqp091.Table{}
)

// What the snippets take from their surroundings.
var (
	db         *sql.DB
	router     *message.Router
	publisher  message.Publisher
	subscriber message.Subscriber
	amqpURL    string
)
`)
	for i, code := range blocks {
		if topLevelDecl.MatchString(code) {
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
		t.Fatalf("the Go blocks of docs/watermill.md do not compile:\n%s\n%s", out, b.String())
	}
}
