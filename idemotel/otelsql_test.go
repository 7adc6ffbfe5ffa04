package idemotel_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// On database/sql with the pool opened through otelsql, the SQL spans nest
// under idem's phases as docs/observability.md says: the claim's INSERT
// under idem.claim, the handler's write under idem.handler, the answer's
// UPDATE under idem.commit, and the COMMIT itself under idem.claim, where
// the transaction began (database/sql sends it with that context).
func TestOtelsqlSpansNestUnderThePhases(t *testing.T) {
	w := newWorld(t, "database/sql", setup{otelsql: true})
	require.Equal(t, http.StatusOK, w.post("evt_1", `{"a":1}`))
	s := w.ended()
	delivery := s.one(t, "idem test")
	phase := map[string]sdktrace.ReadOnlySpan{}
	for _, name := range []string{"idem.claim", "idem.handler", "idem.commit"} {
		phase[name] = s.one(t, name)
		within(t, delivery, phase[name])
	}
	// parentOf names the idem phase whose child the span running stmt is.
	parentOf := func(stmt string) string {
		t.Helper()
		for _, sp := range s {
			if strings.HasPrefix(statement(sp), stmt) {
				for name, p := range phase {
					if sp.Parent().SpanID() == p.SpanContext().SpanID() {
						return name
					}
				}
				return "another span"
			}
		}
		t.Fatalf("no span ran %q among %v", stmt, s.names())
		return ""
	}
	assert.Equal(t, "idem.claim", parentOf(`INSERT INTO "`+w.table+`"`), "the claim")
	assert.Equal(t, "idem.handler", parentOf(`INSERT INTO `+w.ledger), "the handler's write")
	assert.Equal(t, "idem.commit", parentOf(`UPDATE "`+w.table+`"`), "the answer")
	commits := s.named("sql.tx.commit")
	require.Len(t, commits, 1)
	assert.Equal(t, phase["idem.claim"].SpanContext().SpanID(), commits[0].Parent().SpanID(),
		"database/sql sends COMMIT with the context the transaction began with")
}

// statement is the SQL text a driver span carries, if any.
func statement(sp sdktrace.ReadOnlySpan) string {
	for _, a := range sp.Attributes() {
		if a.Key == "db.statement" || a.Key == "db.query.text" {
			return a.Value.AsString()
		}
	}
	return ""
}
