package main

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

// chi routes on the path as sent (r.URL.RawPath when there is one), so a
// wildcard takes each spelling of a path as it comes: one captured
// delivery, sent under every spelling of its path, ships once, and two
// accounts behind one wildcard stay two endpoints (issue 28, F1).
func TestChiWildcardPathSpellingsAreOneEndpoint(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	mw, err := idem.New(db, idem.Options{KeyFunc: idem.Shopify()})
	require.NoError(t, err)
	r := chi.NewRouter()
	r.Route("/webhooks", func(r chi.Router) {
		r.Use(mw.Handler)
		r.Post("/{account}/orders-create", ordersCreate)
	})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	const body = `{"id":820982911946154508,"email":"jon@example.com","total_price":"199.00"}`
	fulfillments := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM fulfillments`) }

	assert.Positive(t, webhooktest.PostSpellings(t, srv.URL, "/webhooks/acct_1/orders-create", body, "X-Shopify-Event-Id", "b2e1"), "the wildcard took escaped spellings")
	assert.Equal(t, 1, fulfillments(), "one fulfillment for every spelling")
	webhooktest.PostSpellings(t, srv.URL, "/webhooks/acct_2/orders-create", body, "X-Shopify-Event-Id", "b2e1")
	assert.Equal(t, 2, fulfillments(), "another account's endpoint runs the event itself")
}
