package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestGin(t *testing.T) {
	t.Parallel()
	gin.SetMode(gin.TestMode)
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	h, err := newRouter(db)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	url := srv.URL + "/webhooks/stripe"
	const body = `{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1","amount":1999}}}`

	first := webhooktest.Post(t, url, body, "Content-Type", "application/json")
	require.Equal(t, http.StatusCreated, first.Status, "body: %s", first.Body)
	for range 2 {
		webhooktest.AssertReplay(t, first, webhooktest.Post(t, url, body, "Content-Type", "application/json"))
	}
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM payments`), "the payment is recorded once")

	// c.AbortWithStatusJSON(400): the client gets the 400, and nothing is
	// stored, so a corrected redelivery runs.
	bad := webhooktest.Post(t, url, `{"id":"evt_2","type":"payment_intent.succeeded"}`, "Content-Type", "application/json")
	assert.Equal(t, http.StatusBadRequest, bad.Status)
	assert.Zero(t, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE event_id = 'evt_2'`))

	health := webhooktest.Do(t, http.MethodGet, srv.URL+"/healthz", "")
	assert.Equal(t, http.StatusOK, health.Status, "routes outside the group are not behind the middleware")
}
