package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	xmodule "golang.org/x/mod/module"
	"golang.org/x/mod/sumdb/dirhash"
	modzip "golang.org/x/mod/zip"
)

// writeProxy writes a file-system module proxy into out (the layout of the
// GOPROXY protocol, served by the go command from a file:// URL) holding
// every module of mods at version, zipped as the go command zips a tagged
// commit. A sub-module without a LICENSE gets the repository's, as the go
// command does. Notes go to notes, such as a requirement on a sibling
// module at another version than the one rehearsed.
func writeProxy(out, version string, when time.Time, mods []module, notes io.Writer) error {
	if out == "" {
		return fmt.Errorf("-out is required")
	}
	root := mods[0] // published starts with the repository's root
	license, _ := os.ReadFile(filepath.Join(root.dir, "LICENSE"))
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, when.UTC()})
	if err != nil {
		return err
	}
	for _, m := range mods {
		reqs, err := requires(m.goMod, root.path)
		if err != nil {
			return err
		}
		for _, r := range reqs {
			if !strings.HasSuffix(r, " "+version) {
				fmt.Fprintf(notes, "note: %s requires %s, not the rehearsed %s\n", m.path, r, version)
			}
		}
		if license != nil && m.dir != root.dir {
			if _, err := os.Stat(filepath.Join(m.dir, "LICENSE")); os.IsNotExist(err) {
				if err := os.WriteFile(filepath.Join(m.dir, "LICENSE"), license, 0o644); err != nil {
					return err
				}
			}
		}
		escaped, err := xmodule.EscapePath(m.path)
		if err != nil {
			return err
		}
		dir := filepath.Join(out, filepath.FromSlash(escaped), "@v")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		var zip bytes.Buffer
		if err := modzip.CreateFromDir(&zip, xmodule.Version{Path: m.path, Version: version}, m.dir); err != nil {
			return err
		}
		for name, data := range map[string][]byte{
			"list":            []byte(version + "\n"),
			version + ".info": info,
			version + ".mod":  m.goMod,
			version + ".zip":  zip.Bytes(),
		} {
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}

// proxySums returns the go.sum lines of every module version in a proxy
// written by writeProxy: the hash of its zip and the hash of its go.mod.
func proxySums(proxy string) ([]string, error) {
	if proxy == "" {
		return nil, fmt.Errorf("-proxy is required")
	}
	var zips []string
	err := filepath.WalkDir(proxy, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".zip") {
			zips = append(zips, p)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	var lines []string
	for _, z := range zips {
		escaped, err := filepath.Rel(proxy, filepath.Dir(filepath.Dir(z)))
		if err != nil {
			return nil, err
		}
		path, err := xmodule.UnescapePath(filepath.ToSlash(escaped))
		if err != nil {
			return nil, err
		}
		version := strings.TrimSuffix(filepath.Base(z), ".zip")
		zipHash, err := dirhash.HashZip(z, dirhash.Hash1)
		if err != nil {
			return nil, err
		}
		goMod, err := os.ReadFile(strings.TrimSuffix(z, ".zip") + ".mod")
		if err != nil {
			return nil, err
		}
		modHash, err := dirhash.Hash1([]string{"go.mod"}, func(string) (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(goMod)), nil
		})
		if err != nil {
			return nil, err
		}
		lines = append(lines, path+" "+version+" "+zipHash, path+" "+version+"/go.mod "+modHash)
	}
	return lines, nil
}
