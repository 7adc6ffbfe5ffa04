package main

import (
	"bytes"
	"context"
	"database/sql"
	"net"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func runDemo(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestDemoVerdictHolds(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	code, out, errOut := runDemo(t, "-database-url", url, "-events", "60", "-deliveries", "4", "-concurrency", "8", "-keep")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errOut)
	assert.Contains(t, out, "VERDICT: PASS")
	assert.Regexp(t, `422 reused id\s+3\s`, out, "one event in 25 reuses its id")
	assert.Regexp(t, `replays\s+180\s`, out, "60 events × 4 deliveries, one original each")

	// Check the ledger without the demo's own code.
	schema := regexp.MustCompile(`schema (idem_demo_\w+)`).FindStringSubmatch(out)
	require.Len(t, schema, 2, out)
	assert.Equal(t, 60, webhooktest.Count(t, db, `SELECT count(*) FROM `+schema[1]+`.ledger`))
	assert.Equal(t, 60, webhooktest.Count(t, db, `SELECT count(DISTINCT event_id) FROM `+schema[1]+`.ledger`))

	t.Run("without -keep, the run's schema is dropped", func(t *testing.T) {
		code, out, errOut := runDemo(t, "-database-url", url, "-events", "10", "-deliveries", "3", "-concurrency", "4")
		require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errOut)
		assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'idem_demo_%'`),
			"only the kept schema is left")
	})
}

func TestDemoWithoutTheMiddlewareFailsItsVerdict(t *testing.T) {
	t.Parallel()
	code, out, errOut := runDemo(t, "-database-url", testdb.URL(t), "-events", "30", "-deliveries", "3", "-no-idem")
	assert.Equal(t, 1, code, "stderr:\n%s", errOut)
	assert.Contains(t, out, "VERDICT: FAIL")
	assert.Contains(t, out, "30 events written more than once")
}

func TestDemoExplainsAnUnreachableDatabaseInOneLine(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nobody listens there now

	code, out, errOut := runDemo(t, "-database-url", "postgres://postgres@"+addr+"/postgres?sslmode=disable")
	assert.Equal(t, 1, code)
	assert.Empty(t, out)
	assert.Equal(t, 1, strings.Count(errOut, "\n"), "one line: %q", errOut)
	assert.Contains(t, errOut, "cannot reach PostgreSQL")
	assert.Contains(t, errOut, "docker run")
}

func TestDemoFlags(t *testing.T) {
	t.Parallel()
	code, _, errOut := runDemo(t, "-h")
	assert.Equal(t, 0, code)
	for _, f := range []string{"-events", "-deliveries", "-concurrency", "-database-url"} {
		assert.Contains(t, errOut, f)
	}
	code, _, errOut = runDemo(t, "-events", "0")
	assert.Equal(t, 2, code)
	assert.Contains(t, errOut, "at least 1")
}
