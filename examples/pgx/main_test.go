package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
	"github.com/pgidem/idem/examples/pgx/paymentsdb"
)

func paymentEvent(id string, amount int) string {
	return fmt.Sprintf(`{"id":%q,"object":"event","type":"payment_intent.succeeded","data":{"object":{"id":"pi_%s","amount":%d,"currency":"usd"}}}`, id, id, amount)
}

func TestPgx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := newPool(ctx, testdb.URL(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close) // before testdb drops the database
	require.NoError(t, migrate(ctx, pool))
	h, err := newServer(pool)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	url := srv.URL + "/webhooks/stripe"
	send := func(body string) webhooktest.Reply {
		return webhooktest.Post(t, url, body, "Content-Type", "application/json")
	}
	queries := paymentsdb.New(pool)
	payments := func() int64 {
		n, err := queries.CountPayments(ctx)
		require.NoError(t, err)
		return n
	}

	t.Run("an event delivered three times is recorded once and replayed", func(t *testing.T) {
		body := paymentEvent("evt_1", 2000)
		first := send(body)
		require.Equal(t, http.StatusCreated, first.Status, "body: %s", first.Body)
		assert.JSONEq(t, `{"payment_id":1}`, string(first.Body))
		for range 2 {
			again := send(body)
			webhooktest.AssertReplay(t, first, again)
			assert.Equal(t, "true", again.Header.Get("Idempotent-Replayed"))
			assert.Equal(t, first.Body, again.Body, "byte for byte")
		}
		assert.EqualValues(t, 1, payments())
	})

	t.Run("another body under the same event id is refused", func(t *testing.T) {
		r := send(paymentEvent("evt_1", 1))
		assert.Equal(t, http.StatusUnprocessableEntity, r.Status, "body: %s", r.Body)
		assert.False(t, r.Replayed())
		assert.EqualValues(t, 1, payments())
	})

	t.Run("a refused payment rolls back and its retry runs again", func(t *testing.T) {
		bad := `{"id":"evt_2","type":"payment_intent.succeeded","data":{"object":{"amount":0,"currency":"usd"}}}`
		assert.Equal(t, http.StatusBadRequest, send(bad).Status)
		// Not 2xx: nothing was kept for evt_2, so the corrected event runs.
		fixed := send(paymentEvent("evt_2", 500))
		require.Equal(t, http.StatusCreated, fixed.Status, "body: %s", fixed.Body)
		assert.False(t, fixed.Replayed())
		assert.EqualValues(t, 2, payments())
	})

	t.Run("other event types are acknowledged once", func(t *testing.T) {
		body := `{"id":"evt_3","object":"event","type":"customer.created","data":{"object":{"id":"cus_1"}}}`
		first := send(body)
		require.Equal(t, http.StatusOK, first.Status)
		webhooktest.AssertReplay(t, first, send(body))
		assert.EqualValues(t, 2, payments())
	})

	t.Run("only POST /webhooks/stripe is routed", func(t *testing.T) {
		assert.Equal(t, http.StatusMethodNotAllowed, webhooktest.Do(t, http.MethodGet, url, "").Status)
		assert.Equal(t, http.StatusNotFound, webhooktest.Post(t, srv.URL+"/webhooks/acme", paymentEvent("evt_4", 100)).Status)
		assert.EqualValues(t, 2, payments())
	})
}

func TestHandlerOutsideTheMiddleware(t *testing.T) {
	t.Parallel()
	rec := httptest.NewRecorder()
	newHandler(nil).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/webhooks/stripe", nil))
	assert.Equal(t, http.StatusInternalServerError, rec.Code)
}
