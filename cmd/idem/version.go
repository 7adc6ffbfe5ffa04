package main

import (
	"fmt"
	"runtime/debug"
	"strings"
)

// versionText is what idem version prints for the build info bi (nil when
// the binary carries none): the module's version, then the VCS revision
// when the build recorded one (go build -buildvcs, the default in a
// checkout), then the Go version.
func versionText(bi *debug.BuildInfo) string {
	if bi == nil {
		return "idem (no build information)\n"
	}
	var b strings.Builder
	version := bi.Main.Version
	if version == "" {
		version = "(devel)"
	}
	fmt.Fprintf(&b, "idem %s\n", version)
	if bi.Main.Path != "" {
		fmt.Fprintf(&b, "module %s\n", bi.Main.Path)
	}
	vcs := map[string]string{}
	for _, s := range bi.Settings {
		vcs[s.Key] = s.Value
	}
	if rev := vcs["vcs.revision"]; rev != "" {
		fmt.Fprintf(&b, "revision %s", rev)
		if t := vcs["vcs.time"]; t != "" {
			fmt.Fprintf(&b, " (%s)", t)
		}
		if vcs["vcs.modified"] == "true" {
			b.WriteString(", with uncommitted changes")
		}
		b.WriteByte('\n')
	}
	if bi.GoVersion != "" {
		fmt.Fprintf(&b, "built with %s\n", bi.GoVersion)
	}
	return b.String()
}
