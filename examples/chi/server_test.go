package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestChi(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	h, err := newServer(db, prometheus.NewRegistry())
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	url := srv.URL + "/webhooks/shopify/orders-create"
	const body = `{"id":820982911946154508,"email":"jon@example.com","total_price":"199.00"}`

	first := webhooktest.Post(t, url, body, "X-Shopify-Event-Id", "8f1e5c3a")
	require.Equal(t, http.StatusOK, first.Status, "body: %s", first.Body)
	for range 2 {
		webhooktest.AssertReplay(t, first, webhooktest.Post(t, url, body, "X-Shopify-Event-Id", "8f1e5c3a"))
	}
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM fulfillments`), "the order ships once")

	bad := webhooktest.Post(t, url, `{"id":"nope"}`, "X-Shopify-Event-Id", "0b7d")
	assert.Equal(t, http.StatusBadRequest, bad.Status)
	assert.Zero(t, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE event_id = '0b7d'`),
		"a 4xx answer is not stored: a fixed redelivery runs again")

	t.Run("/metrics counts the outcomes and is not behind the middleware", func(t *testing.T) {
		m := webhooktest.Do(t, http.MethodGet, srv.URL+"/metrics", "")
		require.Equal(t, http.StatusOK, m.Status)
		assert.Contains(t, string(m.Body), `idem_requests_total{code="200",outcome="completed",source="shopify"} 1`)
		assert.Contains(t, string(m.Body), `idem_requests_total{code="200",outcome="replayed",source="shopify"} 2`)
		assert.Contains(t, string(m.Body), `idem_requests_total{code="400",outcome="rolled_back",source="shopify"} 1`)
		assert.Contains(t, string(m.Body), `idem_request_duration_seconds_count{outcome="replayed"} 2`)
	})

	// chi routes on the path as sent: escaped spellings of the fixed route
	// are not found, and none runs the order again (issue 28, F1).
	t.Run("a delivery sent under every spelling of its path ships once", func(t *testing.T) {
		webhooktest.PostSpellings(t, srv.URL, "/webhooks/shopify/orders-create", body, "X-Shopify-Event-Id", "c4d7")
		assert.Equal(t, 2, webhooktest.Count(t, db, `SELECT count(*) FROM fulfillments`), "one more order: c4d7's")
	})
}
