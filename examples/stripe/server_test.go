package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/idem/examples/internal/testdb"
	"github.com/pgidem/idem/examples/internal/webhooktest"
)

const secret = "whsec_test_secret"

// sign returns a Stripe-Signature header for payload, as Stripe computes it.
func sign(payload, secret string, at time.Time) string {
	return fmt.Sprintf("t=%d,v1=%s", at.Unix(), hex.EncodeToString(signatureMAC([]byte(payload), secret, at.Unix())))
}

func paymentEvent(id string, amount int) string {
	return fmt.Sprintf(`{"id":%q,"object":"event","type":"payment_intent.succeeded","data":{"object":{"id":"pi_%s","amount":%d,"currency":"usd"}}}`, id, id, amount)
}

func TestStripe(t *testing.T) {
	t.Parallel()
	db := testdb.Open(t)
	require.NoError(t, migrate(context.Background(), db))
	h, err := newServer(db, secret)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	url := srv.URL + "/webhooks/stripe"
	send := func(body, signature string) webhooktest.Reply {
		return webhooktest.Post(t, url, body, "Content-Type", "application/json", "Stripe-Signature", signature)
	}
	payments := func() int { return webhooktest.Count(t, db, `SELECT count(*) FROM stripe_payments`) }
	claimed := func(id string) int {
		return webhooktest.Count(t, db, `SELECT count(*) FROM webhook_idempotency WHERE event_id = $1`, id)
	}

	t.Run("a signed event sent twice is recorded once and replayed", func(t *testing.T) {
		body := paymentEvent("evt_1", 2000)
		first := send(body, sign(body, secret, time.Now()))
		require.Equal(t, http.StatusOK, first.Status, "body: %s", first.Body)
		assert.JSONEq(t, `{"received":true,"payment_id":1}`, string(first.Body))
		// Stripe signs every retry anew: same body, new timestamp.
		again := send(body, sign(body, secret, time.Now().Add(time.Second)))
		webhooktest.AssertReplay(t, first, again)
		assert.Equal(t, 1, payments())
	})

	t.Run("a forged event is refused before it can claim the id", func(t *testing.T) {
		genuine := paymentEvent("evt_2", 500)
		forged := paymentEvent("evt_2", 1)
		r := send(forged, sign(forged, "whsec_guessed", time.Now()))
		assert.Equal(t, http.StatusBadRequest, r.Status)
		assert.Zero(t, claimed("evt_2"), "nothing claimed for the forgery")
		// Had the forgery claimed evt_2, the genuine event would now get 422.
		ok := send(genuine, sign(genuine, secret, time.Now()))
		assert.Equal(t, http.StatusOK, ok.Status, "body: %s", ok.Body)
		assert.Equal(t, 2, payments())
	})

	t.Run("a replayed capture outside the tolerance is refused", func(t *testing.T) {
		body := paymentEvent("evt_3", 700)
		r := send(body, sign(body, secret, time.Now().Add(-2*signatureTolerance)))
		assert.Equal(t, http.StatusBadRequest, r.Status)
		assert.Zero(t, claimed("evt_3"))
	})

	t.Run("other event types are acknowledged once", func(t *testing.T) {
		body := `{"id":"evt_4","object":"event","type":"customer.created","data":{"object":{"id":"cus_1"}}}`
		first := send(body, sign(body, secret, time.Now()))
		require.Equal(t, http.StatusOK, first.Status)
		webhooktest.AssertReplay(t, first, send(body, sign(body, secret, time.Now())))
		assert.Equal(t, 2, payments())
	})
}

func TestCheckSignature(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	payload := `{"id":"evt_1"}`
	good := hex.EncodeToString(signatureMAC([]byte(payload), secret, now.Unix()))
	other := hex.EncodeToString(signatureMAC([]byte(payload), "whsec_old", now.Unix()))
	cases := []struct {
		name, header string
		want         error
	}{
		{"a valid v1 signature", fmt.Sprintf("t=%d,v1=%s", now.Unix(), good), nil},
		{"the valid one among several v1 (secret being rolled)", fmt.Sprintf("t=%d,v1=%s,v1=%s,v0=abc", now.Unix(), other, good), nil},
		{"spaces after commas", fmt.Sprintf("t=%d, v1=%s", now.Unix(), good), nil},
		{"an empty header", "", errNoSignature},
		{"no timestamp", "v1=" + good, errNoSignature},
		{"two timestamps", fmt.Sprintf("t=%d,t=%d,v1=%s", now.Unix(), now.Unix(), good), errNoSignature},
		{"only a v0 signature", fmt.Sprintf("t=%d,v0=%s", now.Unix(), good), errNoSignature},
		{"a signature made with another secret", fmt.Sprintf("t=%d,v1=%s", now.Unix(), other), errBadSignature},
		{"the timestamp changed after signing", fmt.Sprintf("t=%d,v1=%s", now.Unix()+1, good), errBadSignature},
		{"too old", fmt.Sprintf("t=%d,v1=%s", now.Add(-signatureTolerance-time.Second).Unix(), good), errStale},
		{"too far in the future", fmt.Sprintf("t=%d,v1=%s", now.Add(signatureTolerance+time.Second).Unix(), good), errStale},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.ErrorIs(t, checkSignature(c.header, []byte(payload), secret, now), c.want)
		})
	}
}
