package idemui_test

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

// The Go blocks of docs/operator-ui.md (fenced as golang, so that the root
// module's doc test, which cannot import this module, leaves them to this
// one) compile against this module: a block that declares functions is put
// at the top level, any other in a function body.
func TestDocCodeCompiles(t *testing.T) {
	text, err := os.ReadFile("../docs/operator-ui.md")
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
	if len(blocks) < 2 {
		t.Fatalf("found %d golang blocks in docs/operator-ui.md; the parser is broken", len(blocks))
	}
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"log"
	"net/http"
	"os"

	"github.com/pgidem/idem/idemui"
)

var (
	_ = sha256.Sum256
	_ = subtle.ConstantTimeCompare
	_ = log.Fatal
	_ = os.Getenv
	_ = idemui.New
)

// What the snippets take from their surroundings.
var (
	db  *sql.DB
	mux *http.ServeMux
)
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
		t.Fatalf("the Go blocks of docs/operator-ui.md do not compile:\n%s\n%s", out, b.String())
	}
}
