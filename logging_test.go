package idem_test

import (
	"bytes"
	"log/slog"
	"net/http"
	"sync"
	"testing"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
)

type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *logBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *logBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

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
