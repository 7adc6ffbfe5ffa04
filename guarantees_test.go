package idem_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestGuaranteesNameRealTests keeps the README's Guarantees section honest:
// every test or fuzz target it names as the check of a promise exists in
// this package.
func TestGuaranteesNameRealTests(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	_, rest, ok := strings.Cut(string(b), "\n## Guarantees\n")
	require.True(t, ok, "README.md has no Guarantees section")
	section, _, _ := strings.Cut(rest, "\n## ")
	named := regexp.MustCompile("`((?:Test|Fuzz)[A-Za-z0-9_]+)`").FindAllStringSubmatch(section, -1)
	require.NotEmpty(t, named, "the Guarantees section names no tests")

	defined := map[string]bool{}
	files, err := filepath.Glob("*_test.go")
	require.NoError(t, err)
	funcs := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz)[A-Za-z0-9_]+)\(`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range funcs.FindAllSubmatch(b, -1) {
			defined[string(m[1])] = true
		}
	}
	for _, m := range named {
		assert.True(t, defined[m[1]], "the Guarantees section names %s, which no test file defines", m[1])
	}
}
