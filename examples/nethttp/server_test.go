package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

func TestNetHTTP(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	h, err := setup(context.Background(), db)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	inbox := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM inbox`) }

	t.Run("a duplicate delivery is replayed and stored once", func(t *testing.T) {
		first := webhooktest.Post(t, srv.URL+"/webhooks/acme", `{"n": 1}`, "X-Event-Id", "evt_1")
		require.Equal(t, http.StatusAccepted, first.Status, "body: %s", first.Body)
		for range 3 {
			dup := webhooktest.Post(t, srv.URL+"/webhooks/acme", `{"n": 1}`, "X-Event-Id", "evt_1")
			webhooktest.AssertReplay(t, first, dup)
		}
		assert.Equal(t, 1, inbox())
	})

	t.Run("the route's source scopes the event id", func(t *testing.T) {
		r := webhooktest.Post(t, srv.URL+"/webhooks/globex", `{"n": 1}`, "X-Event-Id", "evt_1")
		require.Equal(t, http.StatusAccepted, r.Status)
		assert.False(t, r.Replayed(), "globex's evt_1 is not acme's")
		assert.Contains(t, string(r.Body), `"source":"globex"`)
		assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM inbox WHERE source = 'globex' AND event_id = 'evt_1'`))
	})

	t.Run("an unknown source is refused before any claim", func(t *testing.T) {
		r := webhooktest.Post(t, srv.URL+"/webhooks/initech", `{}`, "X-Event-Id", "evt_2")
		assert.Equal(t, http.StatusBadRequest, r.Status)
		assert.Contains(t, string(r.Body), "unknown webhook source")
		assert.Zero(t, webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE event_id = 'evt_2'`))
	})

	t.Run("a delivery without an event id is refused", func(t *testing.T) {
		r := webhooktest.Post(t, srv.URL+"/webhooks/acme", `{}`)
		assert.Equal(t, http.StatusBadRequest, r.Status)
	})

	assert.Equal(t, 2, inbox(), "one row per (source, event id), whatever was sent")
}
