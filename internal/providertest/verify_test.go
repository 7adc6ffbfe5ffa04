package providertest

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/idem"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82/webhook"
)

// Each case is signed by the provider's own library and checked twice: by
// idem's verifying preset and by the provider library's own verifier, which
// must agree with each other and with the expected verdict.

type delivery struct {
	name   string
	body   []byte
	header http.Header
	ok     bool
}

// verdict reports whether kf accepts the delivery; a refusal must wrap
// idem.ErrSignature.
func verdict(t *testing.T, kf idem.KeyFunc, d delivery) bool {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/webhooks/provider", bytes.NewReader(d.body))
	r.Header = d.header.Clone()
	_, err := kf(r, d.body)
	if err != nil {
		require.ErrorIs(t, err, idem.ErrSignature, d.name)
		return false
	}
	return true
}

func TestStripeAgainstStripeGo(t *testing.T) {
	const oldSecret, newSecret = "whsec_stripe_old_3b8e", "whsec_stripe_new_c41d"
	body := []byte(`{"id":"evt_1QmLnB2eZvKYlo2CoHbGqV1x","object":"event","type":"payment_intent.succeeded"}`)
	now := time.Now()
	sign := func(secret string, at time.Time, payload []byte) string {
		return webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: payload, Secret: secret, Timestamp: at}).Header
	}
	with := func(v string) http.Header {
		h := http.Header{}
		if v != "" {
			h.Set("Stripe-Signature", v)
		}
		return h
	}
	v1 := func(header string) string { return header[strings.Index(header, ",v1=")+1:] }
	rolling := sign(newSecret, now, body) + "," + v1(sign(oldSecret, now, body)) // Stripe signs with both while a secret rolls

	cases := []delivery{
		{"signed with the endpoint's secret", body, with(sign(oldSecret, now, body)), true},
		{"signed with the new secret, both configured", body, with(sign(newSecret, now, body)), true},
		{"signed with both secrets while one rolls", body, with(rolling), true},
		{"signed 290 s ago", body, with(sign(oldSecret, now.Add(-290*time.Second), body)), true},
		{"signed 10 minutes ago (stale)", body, with(sign(oldSecret, now.Add(-10*time.Minute), body)), false},
		{"a tampered body", append(bytes.Clone(body[:len(body)-1]), ' ', '}'), with(sign(oldSecret, now, body)), false},
		{"signed with another secret", body, with(sign("whsec_attacker", now, body)), false},
		{"no Stripe-Signature", body, with(""), false},
		{"a malformed Stripe-Signature", body, with("t=" + strconv.FormatInt(now.Unix(), 10) + ",v1=nothex"), false},
		{"a v0 signature only", body, with(webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: body, Secret: oldSecret, Scheme: "v0"}).Header), false},
	}
	rotated := idem.Stripe(newSecret, oldSecret)
	for _, d := range cases {
		t.Run(d.name, func(t *testing.T) {
			assert.Equal(t, d.ok, verdict(t, rotated, d), "idem.Stripe")
			lib := false
			for _, s := range []string{newSecret, oldSecret} {
				lib = lib || webhook.ValidatePayloadWithTolerance(d.body, d.header.Get("Stripe-Signature"), s, 300*time.Second) == nil
			}
			assert.Equal(t, d.ok, lib, "stripe-go's own verifier")
		})
	}
	t.Run("only the old secret configured: the new one's signature is refused", func(t *testing.T) {
		assert.False(t, verdict(t, idem.Stripe(oldSecret), cases[1]))
		assert.True(t, verdict(t, idem.Stripe(oldSecret), cases[2]), "the rolling header still carries the old secret's signature")
	})
}

func TestStandardWebhooksAgainstTheirLibrary(t *testing.T) {
	const oldSecret, newSecret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
	body := []byte(`{"type":"invoice.paid","data":{"invoice_id":"inv_19","amount":4200}}`)
	const id = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
	now := time.Now()
	libFor := func(secret string) *standardwebhooks.Webhook {
		wh, err := standardwebhooks.NewWebhook(secret)
		require.NoError(t, err)
		return wh
	}
	signed := func(secret, msgID string, at time.Time, payload []byte) http.Header {
		sig, err := libFor(secret).Sign(msgID, at, payload)
		require.NoError(t, err)
		h := http.Header{}
		h.Set(standardwebhooks.HeaderWebhookID, id)
		h.Set(standardwebhooks.HeaderWebhookTimestamp, strconv.FormatInt(at.Unix(), 10))
		h.Set(standardwebhooks.HeaderWebhookSignature, sig)
		return h
	}
	both := signed(newSecret, id, now, body)
	both.Set(standardwebhooks.HeaderWebhookSignature, both.Get(standardwebhooks.HeaderWebhookSignature)+" "+signed(oldSecret, id, now, body).Get(standardwebhooks.HeaderWebhookSignature))
	noSig := signed(oldSecret, id, now, body)
	noSig.Del(standardwebhooks.HeaderWebhookSignature)
	noTime := signed(oldSecret, id, now, body)
	noTime.Del(standardwebhooks.HeaderWebhookTimestamp)
	badSig := signed(oldSecret, id, now, body)
	badSig.Set(standardwebhooks.HeaderWebhookSignature, "v1,not-base64!")

	cases := []delivery{
		{"signed with the endpoint's secret", body, signed(oldSecret, id, now, body), true},
		{"signed with the new secret, both configured", body, signed(newSecret, id, now, body), true},
		{"two signatures, one per secret", body, both, true},
		{"signed 4 minutes ago", body, signed(oldSecret, id, now.Add(-4*time.Minute), body), true},
		{"signed 6 minutes ago (stale)", body, signed(oldSecret, id, now.Add(-6*time.Minute), body), false},
		{"signed 6 minutes ahead", body, signed(oldSecret, id, now.Add(6*time.Minute), body), false},
		{"a tampered body", []byte(strings.Replace(string(body), "4200", "4201", 1)), signed(oldSecret, id, now, body), false},
		{"signed for another message id", body, signed(oldSecret, "msg_other", now, body), false},
		{"signed with another secret", body, signed("whsec_"+strings.Repeat("QUJD", 8), id, now, body), false},
		{"no webhook-signature", body, noSig, false},
		{"no webhook-timestamp", body, noTime, false},
		{"a malformed webhook-signature", body, badSig, false},
	}
	rotated := idem.StandardWebhooks("billing", newSecret, oldSecret)
	for _, d := range cases {
		t.Run(d.name, func(t *testing.T) {
			assert.Equal(t, d.ok, verdict(t, rotated, d), "idem.StandardWebhooks")
			lib := libFor(newSecret).Verify(d.body, d.header) == nil || libFor(oldSecret).Verify(d.body, d.header) == nil
			assert.Equal(t, d.ok, lib, "the Standard Webhooks library's own verifier")
		})
	}
	t.Run("Svix's header names", func(t *testing.T) {
		h := http.Header{}
		for _, name := range []string{"Id", "Timestamp", "Signature"} {
			h.Set("Svix-"+name, cases[0].header.Get("Webhook-"+name))
		}
		assert.True(t, verdict(t, idem.StandardWebhooks("clerk", oldSecret), delivery{"svix", body, h, true}))
		assert.False(t, verdict(t, idem.StandardWebhooks("clerk", newSecret), delivery{"svix, wrong secret", body, h, false}))
	})
}
