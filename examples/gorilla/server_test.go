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

func TestGorilla(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	h, err := newServer(db)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	const body = `{"ref":"refs/heads/main","after":"6113728f","repository":{"full_name":"octo/hello"}}`
	deliver := func(hook, guid, event string) webhooktest.Reply {
		return webhooktest.Post(t, srv.URL+"/webhooks/github", body,
			"X-GitHub-Event", event, "X-GitHub-Delivery", guid, "X-GitHub-Hook-ID", hook)
	}
	builds := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM builds`) }

	first := deliver("42", "72d3162e", "push")
	require.Equal(t, http.StatusCreated, first.Status, "body: %s", first.Body)
	redelivered := deliver("42", "72d3162e", "push")
	webhooktest.AssertReplay(t, first, redelivered)
	assert.Equal(t, 1, builds(), "a redelivery builds nothing more")

	t.Run("another hook on the same event is another key", func(t *testing.T) {
		other := deliver("43", "72d3162e", "push")
		require.Equal(t, http.StatusCreated, other.Status)
		assert.False(t, other.Replayed())
		assert.Equal(t, 2, builds())
	})

	t.Run("other events are acknowledged once and replayed", func(t *testing.T) {
		ping := deliver("42", "0a1b2c3d", "ping")
		require.Equal(t, http.StatusNoContent, ping.Status)
		webhooktest.AssertReplay(t, ping, deliver("42", "0a1b2c3d", "ping"))
		assert.Equal(t, 2, builds())
	})

	// gorilla/mux routes on the decoded path: /webhooks/%67ithub reaches
	// the same handler as /webhooks/github (issue 28, F1).
	t.Run("a delivery sent under every spelling of its path builds once", func(t *testing.T) {
		before := builds()
		replays := webhooktest.PostSpellings(t, srv.URL, "/webhooks/github", body,
			"X-GitHub-Event", "push", "X-GitHub-Delivery", "5f2b9c1e", "X-GitHub-Hook-ID", "42")
		assert.Equal(t, len(webhooktest.Spellings("/webhooks/github"))-1, replays, "every spelling reaches the route")
		assert.Equal(t, before+1, builds(), "one build, however the path is spelled")
	})

	t.Run("routes outside the sub-router are not claimed", func(t *testing.T) {
		r := webhooktest.Post(t, srv.URL+"/elsewhere", body)
		assert.Equal(t, http.StatusNotFound, r.Status)
	})
}
