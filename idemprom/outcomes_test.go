package idemprom_test

import (
	"go/parser"
	"go/token"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemprom"
)

// rootOutcomes returns every Outcome the idem package defines: the values
// from 1 up to the first one without a name of its own (String answers
// "Outcome(n)" for those).
func rootOutcomes() []idem.Outcome {
	var all []idem.Outcome
	for o := idem.Outcome(1); !strings.HasPrefix(o.String(), "Outcome("); o++ {
		all = append(all, o)
	}
	return all
}

// The package documentation lists the values of the outcome label; it must
// name every outcome the middleware reports, and nothing else, so that a
// new outcome in idem fails here until it is documented.
func TestDocumentedOutcomesAreTheRootsOutcomes(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "idemprom.go", nil, parser.ParseComments|parser.PackageClauseOnly)
	require.NoError(t, err)
	m := regexp.MustCompile(`the outcome \(([^)]*?)(?::[^)]*)?\)`).FindStringSubmatch(f.Doc.Text())
	require.NotNil(t, m, "the package doc lists the outcomes as: the outcome (completed, replayed, ...)")
	documented := strings.Fields(strings.ReplaceAll(m[1], ",", " "))
	var names []string
	for _, o := range rootOutcomes() {
		names = append(names, o.String())
	}
	require.Contains(t, names, "fenced", "rootOutcomes finds every outcome, up to the last")
	assert.ElementsMatch(t, names, documented, "the outcomes of idem_requests_total in the package doc")
}

// Every outcome becomes its own label value, the name the doc lists.
func TestEveryOutcomeIsALabel(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	metrics, err := idemprom.New(reg, idemprom.Options{})
	require.NoError(t, err)
	var want strings.Builder
	want.WriteString("# HELP idem_requests_total Requests handled by the idempotency middleware, by key source, outcome and HTTP status code.\n# TYPE idem_requests_total counter\n")
	for _, o := range rootOutcomes() {
		metrics.Observe(idem.Observation{Outcome: o, Key: idem.Key{Source: "stripe POST /webhooks/stripe", EventID: "evt_1"}, Status: 409})
	}
	var lines []string
	for _, o := range rootOutcomes() {
		lines = append(lines, `idem_requests_total{code="409",outcome="`+o.String()+`",source="stripe"} 1`)
	}
	want.WriteString(strings.Join(lines, "\n") + "\n")
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want.String()), "idem_requests_total"))
}
