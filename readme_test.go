package idem

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// The README names the API; this test keeps it true to the code: every
// idem.Name it mentions and every Options field in its configuration table
// must exist, and every exported Options field must be in that table.
func TestREADMEMatchesTheAPI(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	exported, fields := exportedAPI(t, ".")
	pgxExported, _ := exportedAPI(t, "idempgx")
	opsExported, _ := exportedAPI(t, "idemops")
	pages, _ := filepath.Glob("docs/*.md")
	for _, page := range append(pages, "README.md") {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(`\bidempgx\.([A-Z]\w*)`).FindAllStringSubmatch(string(text), -1) {
			if !pgxExported[m[1]] {
				t.Errorf("%s mentions idempgx.%s, which package idempgx does not export", page, m[1])
			}
		}
		for _, m := range regexp.MustCompile(`\bidemops\.([A-Z]\w*)`).FindAllStringSubmatch(string(text), -1) {
			if !opsExported[m[1]] {
				t.Errorf("%s mentions idemops.%s, which package idemops does not export", page, m[1])
			}
		}
		for _, m := range regexp.MustCompile(`\bidem\.([A-Z]\w*)`).FindAllStringSubmatch(string(text), -1) {
			if !exported[m[1]] {
				t.Errorf("%s mentions idem.%s, which the package does not export", page, m[1])
			}
		}
	}
	section := string(readme)
	if i := strings.Index(section, "## Configuration"); i >= 0 {
		section = section[i:]
		if j := strings.Index(section[3:], "\n## "); j >= 0 {
			section = section[:j+3]
		}
	} else {
		t.Fatal("README has no Configuration section")
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(\\w+)` \\|").FindAllStringSubmatch(section, -1) {
		documented[m[1]] = true
		if !fields[m[1]] {
			t.Errorf("README's configuration table has %s, which Options lacks", m[1])
		}
	}
	for f := range fields {
		if !documented[f] {
			t.Errorf("Options.%s is missing from README's configuration table", f)
		}
	}
}

// exportedAPI parses the non-test files of the package in dir: its exported
// names, and the fields of Options.
func exportedAPI(t *testing.T, dir string) (names, optionFields map[string]bool) {
	t.Helper()
	names, optionFields = map[string]bool{}, map[string]bool{}
	for _, f := range parseSources(t, dir) {
		for _, obj := range f.Scope.Objects {
			if ast.IsExported(obj.Name) {
				names[obj.Name] = true
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok || ts.Name.Name != "Options" {
				return true
			}
			for _, fld := range ts.Type.(*ast.StructType).Fields.List {
				for _, id := range fld.Names {
					optionFields[id.Name] = true
				}
			}
			return false
		})
	}
	return names, optionFields
}

// parseSources parses the non-test Go files of the package in dir.
func parseSources(t *testing.T, dir string) []*ast.File {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var out []*ast.File
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, f)
	}
	return out
}

// TestDocLinksResolve: every relative link of the README and docs/ names a
// file or folder that exists, and every #anchor a heading of its page.
func TestDocLinksResolve(t *testing.T) {
	pages, _ := filepath.Glob("docs/*.md")
	pages = append(pages, "README.md")
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, page := range pages {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(string(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s links to %s, which does not exist", page, target)
					continue
				}
			}
			if anchor != "" && !headingAnchors(t, path)[anchor] {
				t.Errorf("%s links to %s: %s has no such heading", page, target, path)
			}
		}
	}
}

// headingAnchors returns the anchors GitHub gives the headings of a
// Markdown file: lower case, spaces to hyphens, other punctuation dropped.
func headingAnchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var a strings.Builder
		for _, r := range title {
			switch {
			case r == ' ':
				a.WriteByte('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				a.WriteRune(r)
			}
		}
		anchors[a.String()] = true
	}
	return anchors
}

// TestProblemTypesResolve: the type URI of every answer the middleware
// writes names a heading of docs/problems.md.
func TestProblemTypesResolve(t *testing.T) {
	const base = "https://github.com/pgidem/idem/blob/main/docs/problems.md#"
	anchors := headingAnchors(t, "docs/problems.md")
	for _, err := range []error{
		ErrNoKey, ErrInvalidKey, ErrBadBody, ErrSignature, ErrBodyTooLarge, ErrBodyUnreadable, ErrInFlight, ErrConflict,
		ErrPayloadMismatch, ErrLeaseExpired, ErrUnavailable, ErrHandlerTimeout, ErrTxMisuse, ErrTxAborted, ErrResponseTooLarge,
		errors.New("anything else"),
	} {
		p := problemFor(err)
		anchor, ok := strings.CutPrefix(p.Type, base)
		if !ok {
			t.Errorf("%v: type %q is not under %s", err, p.Type, base)
			continue
		}
		if !anchors[anchor] {
			t.Errorf("%v: type %q: docs/problems.md has no heading %q", err, p.Type, anchor)
		}
	}
	// New's warning about an uncapped pool sends the reader here.
	if !headingAnchors(t, "docs/operations.md")["sizing-the-pool"] {
		t.Error("docs/operations.md has no heading 'Sizing the pool', which New's warning names")
	}
}

// TestDocCodeCompiles type-checks every Go block of the README and docs/
// with the Go toolchain, against this module: each block in a package of
// its own, wrapped in a function unless it declares functions itself, with
// the names a snippet takes from its surroundings (ctx, db, pool, mux, ...)
// declared around it. Only "declared and not used" is forgiven: a snippet
// shows how to get a value, not everything done with it.
func TestDocCodeCompiles(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to compile the docs' code: %v", err)
	}
	pages, _ := filepath.Glob("docs/*.md")
	pages = append(pages, "README.md")
	dir, err := os.MkdirTemp(".", ".doccode-") // inside the module; go ./... skips dot directories
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var pkgs []string
	type origin struct {
		page         string
		line, offset int // the block's first line on the page; lines of the file before it
	}
	where := map[string]origin{} // package dir -> where its block is
	for _, page := range pages {
		if _, ok := docModules[filepath.ToSlash(page)]; ok {
			continue // compiled in its module, below
		}
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range goBlocks(string(text)) {
			pkg := filepath.Join(dir, fmt.Sprintf("b%d", len(pkgs)))
			if err := os.Mkdir(pkg, 0o755); err != nil {
				t.Fatal(err)
			}
			file, offset := docBlockFile(b.code)
			if err := os.WriteFile(filepath.Join(pkg, "block.go"), []byte(file), 0o644); err != nil {
				t.Fatal(err)
			}
			pkgs = append(pkgs, "./"+filepath.ToSlash(pkg))
			where[filepath.Base(pkg)] = origin{page, b.line, offset}
		}
	}
	if len(pkgs) < 5 {
		t.Fatalf("found %d Go blocks in the README and docs/; the parser is broken", len(pkgs))
	}
	out, _ := exec.Command(goTool, append([]string{"build", "-gcflags=-e"}, pkgs...)...).CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if line == "" || strings.HasPrefix(line, "#") || strings.Contains(line, "declared and not used") {
			continue
		}
		at := ""
		if m := regexp.MustCompile(`(b\d+)/block\.go:(\d+):(\d+): (.*)`).FindStringSubmatch(line); m != nil {
			o := where[m[1]]
			n, _ := strconv.Atoi(m[2])
			at, line = fmt.Sprintf("%s:%d:%s: ", o.page, o.line+n-o.offset-1, m[3]), m[4]
		}
		t.Errorf("%sa Go block does not compile: %s", at, line)
	}
	for page, module := range docModules {
		compileInModule(t, goTool, page, module)
	}
}

// docModules are the pages whose Go blocks import a sub-module's
// dependencies (OpenTelemetry, otelpgx), which this module does not have:
// each block is a whole program (package main, its imports), built in the
// module named here, whose go.mod has them.
var docModules = map[string]string{
	"docs/observability.md": "idemotel",
}

// compileInModule builds each Go block of page as a program of its own
// inside module's directory.
func compileInModule(t *testing.T, goTool, page, module string) {
	t.Helper()
	text, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp(module, ".doccode-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	blocks := goBlocks(string(text))
	if len(blocks) == 0 {
		t.Fatalf("%s has no Go block", page)
	}
	var pkgs []string
	for i, b := range blocks {
		if !strings.HasPrefix(b.code, "package ") {
			t.Errorf("%s:%d: a Go block of this page must be a whole program, starting with its package clause", page, b.line)
			continue
		}
		pkg := filepath.Join(dir, fmt.Sprintf("b%d", i))
		if err := os.Mkdir(pkg, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pkg, "main.go"), []byte(b.code), 0o644); err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, "./"+filepath.ToSlash(strings.TrimPrefix(pkg, module+string(filepath.Separator))))
	}
	cmd := exec.Command(goTool, append([]string{"vet"}, pkgs...)...)
	cmd.Dir = module
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s: a Go block does not compile in module %s: %v\n%s", page, module, err, out)
	}
}

type goBlock struct {
	code string
	line int
}

// goBlocks returns the ```go fenced blocks of a Markdown page.
func goBlocks(text string) []goBlock {
	var blocks []goBlock
	var cur *strings.Builder
	start := 0
	for i, line := range strings.Split(text, "\n") {
		switch {
		case cur == nil && strings.TrimSpace(line) == "```go":
			cur, start = &strings.Builder{}, i+2
		case cur != nil && strings.TrimSpace(line) == "```":
			blocks = append(blocks, goBlock{cur.String(), start})
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
	}
	return blocks
}

// docBlockFile is a Go file holding one block and what it refers to, and
// how many of its lines come before the block's first.
func docBlockFile(code string) (string, int) {
	var b strings.Builder
	b.WriteString(`package doccode

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
	"github.com/pgidem/idem/idempgx"
)

var (
	_ = context.Background
	_ = sql.Open
	_ = json.Marshal
	_ = errors.New
	_ = log.Fatal
	_ = slog.Default
	_ = os.Getenv
	_ = net.Dial
	_ = time.Second
	_ = stdlib.OpenDBFromPool
	_ = idem.New
	_ = idempgx.New
	_ = idemops.Check
)

// What the snippets take from their surroundings.
var (
	ctx     context.Context
	db      *sql.DB
	pool    *pgxpool.Pool
	mux     *http.ServeMux
	logger  *slog.Logger
	queries sqlcQueries
	params  any
)

// sqlcQueries stands for the queries sqlc generates in its pgx/v5 mode.
type sqlcQueries struct{}

func (q sqlcQueries) WithTx(pgx.Tx) sqlcQueries { return q }
func (sqlcQueries) RecordPayment(context.Context, any) (int64, error) { return 0, nil }

// callPaymentService stands for a slow call to another service.
func callPaymentService(context.Context, string) (string, error) { return "", nil }
`)
	for _, h := range []string{"handleStripe", "createOrder"} {
		if !strings.Contains(code, "func "+h+"(") {
			b.WriteString("func " + h + "(http.ResponseWriter, *http.Request) {}\n")
		}
	}
	if !regexp.MustCompile(`(?m)^func `).MatchString(code) {
		b.WriteString("func _() {\n")
		code += "}\n"
	}
	offset := strings.Count(b.String(), "\n")
	b.WriteString(code)
	return b.String(), offset
}

// F4 of the adversarial review: the README's multi-tenant example scoped
// keys by X-Tenant-Id, a header the client sets, so one tenant could read
// another's stored answers. No Go block of the docs may build a key's
// Source from a request header; the tenant comes from the authenticated
// identity.
func TestDocsNeverScopeKeysByAClientSetHeader(t *testing.T) {
	pages, _ := filepath.Glob("docs/*.md")
	pages = append(pages, "README.md")
	fromHeader := regexp.MustCompile(`Source:[^\n]*\.Header\.(Get|Values)\(`)
	scoped := 0
	for _, page := range pages {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range goBlocks(string(text)) {
			if m := fromHeader.FindString(b.code); m != "" {
				t.Errorf("%s:%d: a key scoped by a header the client sets: %s", page, b.line, m)
			}
			if strings.Contains(b.code, "r.Context().Value(tenantKey{})") {
				scoped++
			}
		}
	}
	if scoped == 0 {
		t.Error("no Go block of the docs shows a key scoped by the authenticated tenant")
	}
}

// F5: the README's first snippet, and the one the quick start builds the
// middleware with, use the verifying preset, with the secret from the
// environment.
func TestQuickStartVerifiesSignatures(t *testing.T) {
	text, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	verifying := regexp.MustCompile(`idem\.Stripe\(os\.Getenv\("STRIPE_WEBHOOK_SECRET"\)\)`)
	n := 0
	for _, b := range goBlocks(string(text)) {
		if strings.Contains(b.code, "idem.New(") {
			n++
			if n <= 2 && !verifying.MatchString(b.code) {
				t.Errorf("README.md:%d: the middleware is built without signature verification", b.line)
			}
		}
	}
	if n < 2 {
		t.Errorf("README.md builds the middleware in %d Go blocks; want the first snippet and the quick start's", n)
	}
}
