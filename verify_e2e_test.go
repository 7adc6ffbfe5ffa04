package idem_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/pgidem/idem"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stripeSigned is a Stripe-Signature header for body, made here with
// crypto/hmac as Stripe documents it, not with idem's verifier.
func stripeSigned(secret string, at time.Time, body []byte) string {
	ts := strconv.FormatInt(at.Unix(), 10)
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(ts + "."))
	mac.Write(body)
	return "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))
}

// postSigned sends body to f's server with the Stripe-Signature sig ("" for
// none).
func postSigned(f *fixture, body []byte, sig string) reply {
	f.t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, f.srv.URL+"/webhooks/stripe", bytes.NewReader(body))
	require.NoError(f.t, err)
	req.Header.Set("Content-Type", "application/json")
	if sig != "" {
		req.Header.Set("Stripe-Signature", sig)
	}
	return f.send(req)
}

// F5: with the unverified preset, a forged delivery of a real event's id
// was answered 200 and claimed the id, and every real delivery after it got
// 422. With the endpoint's secret, the forgery is refused before anything
// is claimed, and the real event runs.
func TestForgedDeliveryCannotClaimARealEvent(t *testing.T) {
	t.Parallel()
	const secret = "whsec_e2e_5f0c1a"
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe(secret)}, nil)
	real := []byte(`{"id":"evt_real","object":"event","type":"payment_intent.succeeded","data":{"object":{"amount":2000}}}`)
	forged := []byte(`{"id":"evt_real","object":"event","type":"payment_intent.succeeded","data":{"object":{"amount":1}}}`)

	for _, tc := range []struct {
		name string
		body []byte
		sig  string
	}{
		{"no signature", forged, ""},
		{"signed with another secret", forged, stripeSigned("whsec_attacker", time.Now(), forged)},
		{"the real signature on another body", forged, stripeSigned(secret, time.Now(), real)},
		{"a real signature from 10 minutes ago (a replay)", real, stripeSigned(secret, time.Now().Add(-10*time.Minute), real)},
	} {
		r := postSigned(f, tc.body, tc.sig)
		require.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", tc.name, r.body)
		doc := problemDoc(t, r)
		assert.Equal(t, "https://github.com/pgidem/idem/blob/main/docs/problems.md#invalid-signature", doc["type"], tc.name)
		assert.EqualValues(t, http.StatusUnauthorized, doc["status"], tc.name)
	}
	assert.Zero(t, f.keys(), "nothing claimed, nothing stored")
	assert.Zero(t, f.ledgerRows())
	assert.Zero(t, f.runs.Load(), "the handler never ran")
	for _, o := range f.observations() {
		assert.Equal(t, idem.OutcomeRejected, o.Outcome)
		assert.ErrorIs(t, o.Err, idem.ErrSignature)
	}

	first := postSigned(f, real, stripeSigned(secret, time.Now(), real))
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	again := postSigned(f, real, stripeSigned(secret, time.Now(), real)) // Stripe's retry, signed anew
	require.Equal(t, http.StatusCreated, again.status, "%s", again.body)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, 1, f.ledgerRows(), "the real event ran once")
	assert.Equal(t, 1, f.keys())

	forgedAfter := postSigned(f, forged, stripeSigned("whsec_attacker", time.Now(), forged))
	assert.Equal(t, http.StatusUnauthorized, forgedAfter.status, "a forgery after the real event gets no replay either")
}

// The attack the verifying preset answers, on the unverified one: kept as
// the reason the README states the risk beside idem.Stripe().
func TestUnverifiedPresetLetsAForgeryPoisonTheKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t, idem.Options{KeyFunc: idem.Stripe()}, nil)
	forged := postSigned(f, []byte(`{"id":"evt_real","amount":1}`), "")
	require.Equal(t, http.StatusCreated, forged.status, "%s", forged.body)
	real := postSigned(f, []byte(`{"id":"evt_real","amount":2000}`), "")
	assert.Equal(t, http.StatusUnprocessableEntity, real.status, "the real event is never processed")
}

// A custom KeyFunc's own verification gets the same answer by wrapping
// ErrSignature.
func TestCustomKeyFuncSignatureErrorIs401(t *testing.T) {
	t.Parallel()
	kf := func(r *http.Request, body []byte) (idem.Key, error) {
		if r.Header.Get("X-Signature") != "ok" {
			return idem.Key{}, fmt.Errorf("acme: %w: X-Signature does not match", idem.ErrSignature)
		}
		return idem.Key{Source: "acme", EventID: r.Header.Get("X-Event-Id")}, nil
	}
	f := newFixture(t, idem.Options{KeyFunc: kf}, nil)
	r := f.post("evt_1", `{}`, "X-Signature", "forged")
	require.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)
	assert.Contains(t, problemDoc(t, r)["detail"], "X-Signature does not match")
	assert.Zero(t, f.keys())
	assert.Equal(t, http.StatusCreated, f.post("evt_1", `{}`, "X-Signature", "ok").status)
}
