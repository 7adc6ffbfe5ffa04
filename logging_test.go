package idem_test

import (
	"database/sql"
	"log/slog"
	"net/http"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// logBuffer collects the records of a slog handler.
type logBuffer = testdb.LogBuffer

// Refused and failed requests are logged with their source and event id;
// bodies never are.
func TestLogsCarryTheKeyNeverTheBody(t *testing.T) {
	t.Parallel()
	var out logBuffer
	logger := slog.New(slog.NewJSONHandler(&out, nil))
	f := newFixture(t, idem.Options{Logger: logger}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := txFrom(r.Context())
		_ = tx.Commit() // misuse: logged
		_, _ = w.Write([]byte("answer-secret"))
	}))
	f.post("evt_logged", `{"card":"body-secret"}`)
	f.post("", `{"card":"body-secret-2"}`) // no key: 400
	logs := out.String()
	assert.Contains(t, logs, `"event_id":"evt_logged"`)
	assert.Contains(t, logs, `"source":"test"`)
	assert.Contains(t, logs, "ended the middleware's transaction")
	assert.Contains(t, logs, "Missing or invalid idempotency key")
	assert.NotContains(t, logs, "body-secret")
	assert.NotContains(t, logs, "answer-secret")
}

// Without a Logger, refusals and failures go to slog.Default(), as it is
// when they happen; a discarding logger silences them. Not parallel: it
// replaces the process's default logger.
func TestNilLoggerLogsToTheDefault(t *testing.T) {
	var out logBuffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(&out, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })

	f := newFixture(t, idem.Options{}, nil)
	f.post("", `{}`) // no key: 400
	assert.Contains(t, out.String(), "Missing or invalid idempotency key")

	quiet := newFixture(t, idem.Options{Logger: slog.New(slog.DiscardHandler)}, nil)
	before := out.String()
	quiet.post("", `{}`)
	assert.Equal(t, before, out.String())
}

// New warns when the *sql.DB has no connection cap: a retry storm would
// open a connection per request, past max_connections.
func TestNewWarnsAboutAnUncappedPool(t *testing.T) {
	t.Parallel()
	db := idem.OpenTestDB(t)
	table := idem.NewTestTable(t, db)
	var out logBuffer
	logger := slog.New(slog.NewJSONHandler(&out, nil))
	uncapped, err := sql.Open("pgx", idem.TestDatabaseURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { uncapped.Close() })
	_, err = idem.New(uncapped, idem.Options{KeyFunc: idem.Stripe(), Table: table, Logger: logger})
	require.NoError(t, err)
	assert.Contains(t, out.String(), `"level":"WARN"`)
	assert.Contains(t, out.String(), "SetMaxOpenConns")

	var quiet logBuffer
	uncapped.SetMaxOpenConns(8)
	_, err = idem.New(uncapped, idem.Options{KeyFunc: idem.Stripe(), Table: table, Logger: slog.New(slog.NewJSONHandler(&quiet, nil))})
	require.NoError(t, err)
	assert.Empty(t, quiet.String())
}
