package idem_test

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestGuaranteesNameRealTests keeps docs/guarantees.md honest: every test
// or fuzz target it (or any other page of the docs, or the README) names as
// the check of a promise exists in this package, internal/failover, the
// command, or one of the modules beside the root.
func TestGuaranteesNameRealTests(t *testing.T) {
	t.Parallel()
	guarantees, err := os.ReadFile("docs/guarantees.md")
	require.NoError(t, err)
	pattern := regexp.MustCompile("`((?:Test|Fuzz)[A-Za-z0-9_]+)`")
	require.NotEmpty(t, pattern.FindAllSubmatch(guarantees, -1), "docs/guarantees.md names no tests")
	pages, err := filepath.Glob("docs/*.md")
	require.NoError(t, err)
	var named [][]string
	for _, page := range append(pages, "README.md") {
		b, err := os.ReadFile(page)
		require.NoError(t, err)
		for _, m := range pattern.FindAllStringSubmatch(string(b), -1) {
			named = append(named, []string{m[0], m[1], page})
		}
	}

	defined := map[string]bool{}
	files, err := filepath.Glob("*_test.go")
	require.NoError(t, err)
	ops, err := filepath.Glob("idemops/*_test.go") // the operations package's own tests
	require.NoError(t, err)
	files = append(files, ops...)
	failover, err := filepath.Glob("internal/failover/*_test.go") // the tests with PostgreSQL clusters of their own
	require.NoError(t, err)
	files = append(files, failover...)
	ha, err := filepath.Glob("internal/hatest/*_test.go") // under pg_auto_failover (build tag hatest)
	require.NoError(t, err)
	files = append(files, ha...)
	providers, err := filepath.Glob("internal/providertest/*_test.go") // the verifying presets against the providers' libraries
	require.NoError(t, err)
	files = append(files, providers...)
	for _, dir := range []string{"cmd/idem", "idemgin", "idemprom", "idemui", "idemgrpc", "idemwatermill", "idemnats", "idemrabbitmq", "internal/browsertest", "internal/connecttest", "internal/citustest", "internal/hatest"} { // the command and the modules beside the root
		more, err := filepath.Glob(dir + "/*_test.go")
		require.NoError(t, err)
		files = append(files, more...)
	}
	funcs := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz)[A-Za-z0-9_]+)\(`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range funcs.FindAllSubmatch(b, -1) {
			defined[string(m[1])] = true
		}
	}
	for _, m := range named {
		assert.True(t, defined[m[1]], "%s names %s, which no test file defines", m[2], m[1])
	}
}
