package main

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

// A captured, validly signed delivery, sent again within the signature's
// tolerance under every spelling of its path (/webhooks/%73tripe, ...),
// which http.ServeMux routes to the same handler: the signature covers the
// body, not the path, so it verifies every time, and the payment is
// recorded once (issue 28, F1: it was recorded once per spelling).
func TestStripeCapturedDeliveryUnderEverySpellingPaysOnce(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	h, err := newServer(db, secret)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	body := paymentEvent("evt_captured", 4200)
	signature := sign(body, secret, time.Now())
	paths := webhooktest.Spellings("/webhooks/stripe")
	replays := webhooktest.PostSpellings(t, srv.URL, "/webhooks/stripe", body,
		"Content-Type", "application/json", "Stripe-Signature", signature)
	routed := 0 // http.ServeMux does not route an escaped slash to /webhooks/stripe
	for _, p := range paths[1:] {
		if !strings.Contains(strings.ToUpper(p), "%2F") {
			routed++
		}
	}
	assert.Equal(t, routed, replays, "every spelling ServeMux routes reaches the handler, and the signature verifies")
	assert.Equal(t, 1, webhooktest.Count(t, db, `SELECT count(*) FROM stripe_payments`), "one payment")
}
