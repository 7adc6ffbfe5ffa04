// Command modcheck checks what this repository's public modules will hold
// when they are tagged, and builds the module proxy that the publish
// rehearsal (scripts/publish-rehearsal.sh) installs them from.
//
// It is a module of its own so that golang.org/x/mod stays off the library's
// go.mod, and it lives under internal/ because nobody outside this
// repository should depend on it; it is never tagged.
//
// zips and proxy read the repository's files as a commit holds them (-rev,
// default HEAD, exported with git archive, as the go command reads a tagged
// commit), so that files that are not committed can neither hide nor cause
// a problem; -tree reads a directory instead.
//
//	modcheck zips  [-rev HEAD | -tree DIR]
//	    builds each public module's zip the way the go command does and
//	    fails, naming the file, on an executable that is not a script, a
//	    compiled binary (ELF, Mach-O, PE) or a file over 1 MiB.
//	modcheck proxy [-rev HEAD | -tree DIR] -version v0.1.0 -out DIR
//	    writes a file-system module proxy (GOPROXY=file://DIR) holding
//	    every public module at that version, dated with the commit's time:
//	    list, .info, .mod and .zip.
//	modcheck sums  -proxy DIR
//	    prints the go.sum lines of the modules in that proxy, so that the
//	    rehearsal can check where its modules came from.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command line args and returns the exit code: 0 done, 1 the
// check found problems, 2 bad usage or an I/O error.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: modcheck zips|proxy|sums [flags]; see the package comment")
		return 2
	}
	fs := flag.NewFlagSet("modcheck "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	rev := fs.String("rev", "HEAD", "the commit whose files to read")
	tree := fs.String("tree", "", "a directory to read instead of -rev")
	version := fs.String("version", "v0.1.0", "proxy: the version every public module is published at")
	out := fs.String("out", "", "proxy: the directory to write the proxy into")
	proxy := fs.String("proxy", "", "sums: a proxy written by modcheck proxy")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "modcheck %s: %v\n", args[0], err)
		return 2
	}
	when := time.Now().UTC()
	if (args[0] == "zips" || args[0] == "proxy") && *tree == "" {
		dir, err := os.MkdirTemp("", "modcheck-tree-")
		if err != nil {
			return fail(err)
		}
		defer os.RemoveAll(dir)
		if when, err = exportCommit(*rev, dir); err != nil {
			return fail(err)
		}
		*tree = dir
	}
	switch args[0] {
	case "zips":
		mods, err := publicModules(*tree)
		if err != nil {
			return fail(err)
		}
		bad := false
		for _, m := range mods {
			report, err := checkModule(m.dir)
			if err != nil {
				return fail(err)
			}
			fmt.Fprintf(stdout, "%s: %d files, %d bytes\n", m.path, report.files, report.bytes)
			for _, p := range report.problems {
				fmt.Fprintf(stderr, "%s: %s\n", m.path, p)
				bad = true
			}
		}
		if bad {
			fmt.Fprintln(stderr, "modcheck zips: a module zip would ship the files above; remove them (and ignore build outputs in .gitignore)")
			return 1
		}
		return 0
	case "proxy":
		mods, err := publicModules(*tree)
		if err != nil {
			return fail(err)
		}
		if err := writeProxy(*out, *version, when, mods, stderr); err != nil {
			return fail(err)
		}
		return 0
	case "sums":
		lines, err := proxySums(*proxy)
		if err != nil {
			return fail(err)
		}
		for _, l := range lines {
			fmt.Fprintln(stdout, l)
		}
		return 0
	}
	fmt.Fprintf(stderr, "modcheck: unknown command %q (zips, proxy or sums)\n", args[0])
	return 2
}
