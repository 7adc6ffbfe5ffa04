package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	xmodule "golang.org/x/mod/module"
	modzip "golang.org/x/mod/zip"
)

// writeFiles creates the files of a tree under dir: name -> content, with
// mode 0755 for names that end in "*" (the star is dropped).
func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		mode := os.FileMode(0o644)
		if strings.HasSuffix(name, "*") {
			name, mode = strings.TrimSuffix(name, "*"), 0o755
		}
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCheckModuleNamesEachFileThatMustNotShip(t *testing.T) {
	clean := map[string]string{
		"go.mod":                "module example.com/m\n\ngo 1.25\n",
		"m.go":                  "package m\n",
		"scripts/test.sh*":      "#!/bin/sh\nexit 0\n",             // an executable script is source
		"testdata/exactly.json": strings.Repeat("x", maxFileBytes), // at the limit
		// A nested module is not in this module's zip, whatever it holds.
		"nested/go.mod":  "module example.com/m/nested\n",
		"nested/binary*": "\x7fELF\x02\x01\x01",
	}
	cases := []struct {
		name, file, content, want string
	}{
		{"an ELF binary, executable", "testreceiver*", "\x7fELF\x02\x01\x01\x00", "testreceiver: a compiled ELF binary"},
		{"an ELF binary without its exec bits", "cmd/tool.bin", "\x7fELF\x02\x01\x01\x00", "cmd/tool.bin: a compiled ELF binary"},
		{"a Mach-O binary", "idem", "\xcf\xfa\xed\xfe\x07\x00\x00\x01", "idem: a compiled Mach-O binary"},
		{"an executable that is not a script", "run*", "echo hi\n", "run: executable (mode -rwxr-xr-x) and not a script"},
		{"a file over 1 MiB", "testdata/dump.json", strings.Repeat("x", maxFileBytes+1), "testdata/dump.json: 1048577 bytes, over the 1048576-byte limit for one file"},
		{"a file the go command refuses", "bad:name.go", "package m\n", "bad:name.go: malformed file path"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			writeFiles(t, dir, clean)
			r, err := checkModule(dir)
			if err != nil || len(r.problems) != 0 {
				t.Fatalf("before planting: problems %q, err %v; want none", r.problems, err)
			}
			if r.files != 4 {
				t.Errorf("the zip holds %d files, want 4 (go.mod, m.go, the script, the test data)", r.files)
			}
			writeFiles(t, dir, map[string]string{c.file: c.content})
			r, err = checkModule(dir)
			if err != nil {
				t.Fatal(err)
			}
			if len(r.problems) != 1 || !strings.HasPrefix(r.problems[0], c.want) {
				t.Errorf("problems %q, want one that starts with %q", r.problems, c.want)
			}
		})
	}
}

// The check on this repository's own modules: clean at HEAD, and failing,
// with the file named, once a binary (this test's own executable) or a big
// file is planted in a copy.
func TestZipsOfThisRepository(t *testing.T) {
	tree := t.TempDir()
	if _, err := exportCommit("HEAD", tree); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if code := run([]string{"zips", "-tree", tree}, &stdout, &stderr); code != 0 {
		t.Fatalf("modcheck zips at HEAD: exit %d\n%s%s", code, stdout.String(), stderr.String())
	}
	for _, want := range []string{"github.com/pgidem/idem: ", "github.com/pgidem/idem/idemgin: ", "github.com/pgidem/idem/idemprom: ", "github.com/pgidem/idem/idemui: ", "github.com/pgidem/idem/idemgrpc: ", "github.com/pgidem/idem/idemotel: ", "github.com/pgidem/idem/idemrabbitmq: ", "github.com/pgidem/idem/idemwatermill: ", "github.com/pgidem/idem/idemnats: "} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("the report does not name %q:\n%s", want, stdout.String())
		}
	}

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	binary, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tree, "testreceiver"), binary, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFiles(t, tree, map[string]string{"idemprom/testdata/big.txt": strings.Repeat("metric 1\n", maxFileBytes/4)})
	stdout.Reset()
	stderr.Reset()
	if code := run([]string{"zips", "-tree", tree}, &stdout, &stderr); code != 1 {
		t.Fatalf("modcheck zips with planted files: exit %d, want 1\n%s", code, stderr.String())
	}
	for _, want := range []string{
		"github.com/pgidem/idem: testreceiver: a compiled ",
		"github.com/pgidem/idem/idemprom: testdata/big.txt: 2359296 bytes, over the 1048576-byte limit",
	} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr does not say %q:\n%s", want, stderr.String())
		}
	}
}

func TestEveryModuleIsPublishedOrNot(t *testing.T) {
	tree := t.TempDir()
	files := map[string]string{}
	for _, dir := range append(append([]string{}, published...), unpublished...) {
		files[dir+"/go.mod"] = "module example.com/" + dir + "\n"
	}
	writeFiles(t, tree, files)
	if _, err := publicModules(tree); err != nil {
		t.Fatal(err)
	}
	writeFiles(t, tree, map[string]string{"idemfuture/go.mod": "module example.com/idemfuture\n"})
	if _, err := publicModules(tree); err == nil || !strings.Contains(err.Error(), "idemfuture/go.mod is a module that modcheck does not know") {
		t.Errorf("a module in neither list: err %v", err)
	}
}

func TestProxyHoldsValidZipsAndTheirSums(t *testing.T) {
	tree := t.TempDir()
	writeFiles(t, tree, map[string]string{
		"go.mod":       "module example.com/Root\n\ngo 1.25\n",
		"root.go":      "package root\n",
		"LICENSE":      "the license\n",
		"sub/go.mod":   "module example.com/Root/sub\n\ngo 1.25\n\nrequire example.com/Root v0.0.9\n",
		"sub/sub.go":   "package sub\n",
		"sub/x/x.go":   "package x\n",
		"other/go.mod": "module example.com/other\n",
	})
	mods := []module{{dir: tree, path: "example.com/Root"}, {dir: filepath.Join(tree, "sub"), path: "example.com/Root/sub"}}
	for i := range mods {
		var err error
		if mods[i].goMod, err = os.ReadFile(filepath.Join(mods[i].dir, "go.mod")); err != nil {
			t.Fatal(err)
		}
	}
	out := t.TempDir()
	var notes bytes.Buffer
	if err := writeProxy(out, "v1.0.0", time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC), mods, &notes); err != nil {
		t.Fatal(err)
	}
	if want := "note: example.com/Root/sub requires example.com/Root v0.0.9, not the rehearsed v1.0.0\n"; notes.String() != want {
		t.Errorf("notes %q, want %q", notes.String(), want)
	}
	// Upper case is escaped in the proxy's paths, as the go command asks.
	for path, want := range map[string][]string{
		"example.com/!root":     {"LICENSE", "go.mod", "root.go"},
		"example.com/!root/sub": {"LICENSE", "go.mod", "sub.go", "x/x.go"},
	} {
		dir := filepath.Join(out, path, "@v")
		list, err := os.ReadFile(filepath.Join(dir, "list"))
		if err != nil || string(list) != "v1.0.0\n" {
			t.Errorf("%s/list: %q, %v", path, list, err)
		}
		info, err := os.ReadFile(filepath.Join(dir, "v1.0.0.info"))
		if err != nil || string(info) != `{"Version":"v1.0.0","Time":"2026-12-02T03:00:00Z"}` {
			t.Errorf("%s/v1.0.0.info: %s, %v", path, info, err)
		}
		modPath, _ := xmodule.UnescapePath(path)
		cf, err := modzip.CheckZip(xmodule.Version{Path: modPath, Version: "v1.0.0"}, filepath.Join(dir, "v1.0.0.zip"))
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var names []string
		for _, v := range cf.Valid {
			names = append(names, strings.TrimPrefix(v, modPath+"@v1.0.0/"))
		}
		if strings.Join(names, " ") != strings.Join(want, " ") {
			t.Errorf("%s's zip holds %q, want %q", path, names, want)
		}
	}
	sums, err := proxySums(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(sums) != 4 || !strings.HasPrefix(sums[0], "example.com/Root v1.0.0 h1:") || !strings.HasPrefix(sums[1], "example.com/Root v1.0.0/go.mod h1:") {
		t.Errorf("sums: %q", sums)
	}
}
