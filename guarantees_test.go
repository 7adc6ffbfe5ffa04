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

// TestGuaranteesNameRealTests keeps the Guarantees section honest: every
// test or fuzz target it names as the check of a promise exists in this
// package. The section lives in docs/guarantees.md, in README.md, or both.
func TestGuaranteesNameRealTests(t *testing.T) {
	t.Parallel()
	var section strings.Builder
	if b, err := os.ReadFile("docs/guarantees.md"); err == nil {
		section.Write(b)
	}
	if b, err := os.ReadFile("README.md"); err == nil {
		if _, rest, ok := strings.Cut(string(b), "\n## Guarantees\n"); ok {
			body, _, _ := strings.Cut(rest, "\n## ")
			section.WriteString(body)
		}
	}
	named := regexp.MustCompile("`((?:Test|Fuzz)[A-Za-z0-9_]+)`").FindAllStringSubmatch(section.String(), -1)
	require.NotEmpty(t, named, "no Guarantees section naming tests in docs/guarantees.md or README.md")

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
