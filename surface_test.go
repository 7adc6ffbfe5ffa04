package idem

import (
	"go/ast"
	"go/token"
	"sort"
	"strings"
	"testing"
)

// The root package holds what a handler's author needs; operators' tooling
// lives beside it (package idemops). This keeps it so: at most 53 top-level
// exported names other than constants (funcs, methods of exported types,
// types, vars). Raising the bound is a decision, not a side effect: it was
// 50 until OpenTelemetry (package idemotel) needed four names that only the
// engine can provide: Phase (Options.OnPhase, so the driver's SQL spans nest
// under idem's), Stats and Middleware.Stats (the replay cache's size and
// the connections waiting duplicates hold, for gauges), and Observers (to
// feed idemprom and idemotel from one Options.Observer).
func TestRootSurfaceStaysSmall(t *testing.T) {
	const most = 53
	var names []string
	for _, f := range parseSources(t, ".") {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv == nil {
					names = append(names, d.Name.Name)
					continue
				}
				recv := d.Recv.List[0].Type
				if star, ok := recv.(*ast.StarExpr); ok {
					recv = star.X
				}
				if id, ok := recv.(*ast.Ident); ok && id.IsExported() {
					names = append(names, id.Name+"."+d.Name.Name)
				}
			case *ast.GenDecl:
				if d.Tok != token.TYPE && d.Tok != token.VAR {
					continue
				}
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							names = append(names, s.Name.Name)
						}
					case *ast.ValueSpec:
						for _, id := range s.Names {
							if id.IsExported() {
								names = append(names, id.Name)
							}
						}
					}
				}
			}
		}
	}
	sort.Strings(names)
	if len(names) > most {
		t.Errorf("package idem exports %d names other than constants, more than %d: %s", len(names), most, strings.Join(names, ", "))
	}
}
