package main

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
)

// The modules of this repository, by directory. Every go.mod in the tree
// must be in one list, so that a new module cannot be forgotten: either it
// is published (checked and rehearsed) or it is said not to be.
var (
	// published are the modules users go get, each tagged on its own
	// (RELEASING.md).
	published = []string{".", "idemgin", "idemprom", "idemui", "idemgrpc", "idemnats", "idemwatermill", "idemrabbitmq", "idemotel"}
	// unpublished are modules that only this repository uses.
	unpublished = []string{"examples", "bench", "internal/browsertest", "internal/providertest", "internal/connecttest", "internal/tools/modcheck"}
)

// module is one public module in a tree.
type module struct {
	dir   string // its directory in the tree
	path  string // its module path
	goMod []byte // its go.mod, as committed
}

// publicModules returns the published modules of the tree, and fails if the
// tree has a module that neither list names, or lacks a published one.
func publicModules(tree string) ([]module, error) {
	if tree == "" {
		return nil, fmt.Errorf("-tree is required")
	}
	found := map[string]bool{}
	err := filepath.WalkDir(tree, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || d.Name() == ".git" || d.Name() == "vendor") {
			return filepath.SkipDir
		}
		if d.Name() == "go.mod" && !d.IsDir() {
			rel, err := filepath.Rel(tree, filepath.Dir(p))
			if err != nil {
				return err
			}
			found[filepath.ToSlash(rel)] = true
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for dir := range found {
		if !slices.Contains(published, dir) && !slices.Contains(unpublished, dir) {
			return nil, fmt.Errorf("%s/go.mod is a module that modcheck does not know: add it to published or unpublished in modules.go", dir)
		}
	}
	var mods []module
	for _, dir := range published {
		if !found[dir] {
			return nil, fmt.Errorf("the published module %s has no go.mod in %s", dir, tree)
		}
		m := module{dir: filepath.Join(tree, dir)}
		if m.goMod, err = os.ReadFile(filepath.Join(m.dir, "go.mod")); err != nil {
			return nil, err
		}
		if m.path = modfile.ModulePath(m.goMod); m.path == "" {
			return nil, fmt.Errorf("%s/go.mod has no module line", dir)
		}
		mods = append(mods, m)
	}
	return mods, nil
}

// requires returns the requirements of go.mod on other modules of the
// repository (paths that start with root's path), as "path version".
func requires(goMod []byte, root string) ([]string, error) {
	f, err := modfile.ParseLax("go.mod", goMod, nil)
	if err != nil {
		return nil, err
	}
	var reqs []string
	for _, r := range f.Require {
		if r.Mod.Path == root || strings.HasPrefix(r.Mod.Path, root+"/") {
			reqs = append(reqs, r.Mod.Path+" "+r.Mod.Version)
		}
	}
	return reqs, nil
}

// exportCommit writes the files of the commit rev of the repository that
// holds the working directory into dir, with their modes, and returns the
// commit's time.
func exportCommit(rev, dir string) (time.Time, error) {
	out, err := exec.Command("git", "log", "-1", "--format=%cI", rev).Output()
	if err != nil {
		return time.Time{}, fmt.Errorf("git log %s: %w", rev, err)
	}
	when, err := time.Parse(time.RFC3339, strings.TrimSpace(string(out)))
	if err != nil {
		return time.Time{}, err
	}
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		return time.Time{}, fmt.Errorf("git rev-parse --show-toplevel: %w", err)
	}
	cmd := exec.Command("sh", "-c", `git -C "$1" archive --format=tar "$2" | tar -x -C "$3"`, "sh", strings.TrimSpace(string(top)), rev, dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return time.Time{}, fmt.Errorf("git archive %s: %w: %s", rev, err, out)
	}
	return when, nil
}
