package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

// span is what the test reads of stdouttrace's JSON.
type span struct {
	Name        string
	SpanContext struct{ SpanID string }
	Parent      struct{ SpanID string }
	Attributes  []struct {
		Key   string
		Value struct{ Value any }
	}
}

func (s span) attr(key string) any {
	for _, a := range s.Attributes {
		if a.Key == key {
			return a.Value.Value
		}
	}
	return nil
}

func TestOtel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var out bytes.Buffer
	tel, err := newTelemetry(ctx, &out)
	require.NoError(t, err)
	pool, err := newPool(ctx, testdb.URL(t), tel.tp)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrate(ctx, pool))
	h, err := newServer(pool, tel)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	first := webhooktest.Post(t, srv.URL+"/webhooks/orders", `{"amount":2000}`, "X-Event-Id", "evt_1")
	require.Equal(t, http.StatusCreated, first.Status, "body: %s", first.Body)
	again := webhooktest.Post(t, srv.URL+"/webhooks/orders", `{"amount":2000}`, "X-Event-Id", "evt_1")
	webhooktest.AssertReplay(t, first, again)

	resp, err := http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	metrics, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Contains(t, string(metrics), `idem_requests_total{idem_outcome="completed",idem_source="orders"`)
	assert.Contains(t, string(metrics), `idem_requests_total{idem_outcome="replayed",idem_source="orders"`)
	assert.Contains(t, string(metrics), `idem_outcome="replayed"`)
	assert.Contains(t, string(metrics), "idem_claim_duration_seconds_bucket")

	require.NoError(t, tel.shutdown(ctx)) // flushes the spans to out
	var spans []span
	dec := json.NewDecoder(&out)
	for {
		var s span
		if err := dec.Decode(&s); errors.Is(err, io.EOF) {
			break
		} else {
			require.NoError(t, err)
		}
		spans = append(spans, s)
	}
	outcomes := map[string]span{}
	for _, s := range spans {
		if s.Name == "idem orders" {
			outcomes[s.attr("idem.outcome").(string)] = s
		}
	}
	require.Contains(t, outcomes, "completed")
	require.Contains(t, outcomes, "replayed")
	children := func(parent span) []string {
		var names []string
		for _, s := range spans {
			if s.Parent.SpanID == parent.SpanContext.SpanID {
				names = append(names, s.Name)
			}
		}
		return names
	}
	assert.Subset(t, children(outcomes["completed"]), []string{"idem.claim", "idem.handler", "idem.commit"})
	for _, s := range spans {
		if s.Name == "idem.handler" && s.Parent.SpanID == outcomes["completed"].SpanContext.SpanID {
			var sql []string
			for _, c := range children(s) {
				if strings.Contains(c, "INSERT INTO otel_orders") {
					sql = append(sql, c)
				}
			}
			assert.NotEmpty(t, sql, "the handler's INSERT is a span under idem.handler: %v", children(s))
		}
	}
}
