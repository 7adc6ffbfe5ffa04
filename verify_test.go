package idem

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The verifying presets against signatures made by OpenSSL over fixed
// bodies (testdata/signatures/make.sh), not by this package: each provider
// has two secrets (an old and a new one, as during a rotation); GitHub has
// the example of its documentation too. The
// providers' own libraries check Stripe and Standard Webhooks again in
// internal/providertest.

// vector is one line of testdata/signatures/vectors.tsv.
type vector struct {
	provider, secret string
	body             []byte
	signature        string
	ts               time.Time // signed timestamp (Stripe, Standard Webhooks)
	id               string    // signed message id (Standard Webhooks)
}

func loadVectors(t testing.TB) map[string][]vector {
	t.Helper()
	dir := filepath.Join("testdata", "signatures")
	f, err := os.Open(filepath.Join(dir, "vectors.tsv"))
	require.NoError(t, err)
	defer f.Close()
	out := map[string][]vector{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		cols := strings.Split(sc.Text(), "\t")
		require.GreaterOrEqual(t, len(cols), 4, "line %q", sc.Text())
		body, err := os.ReadFile(filepath.Join(dir, cols[2]))
		require.NoError(t, err)
		v := vector{provider: cols[0], secret: cols[1], body: body, signature: cols[3]}
		if len(cols) > 4 {
			sec, err := strconv.ParseInt(cols[4], 10, 64)
			require.NoError(t, err)
			v.ts = time.Unix(sec, 0)
		}
		if len(cols) > 5 {
			v.id = cols[5]
		}
		out[v.provider] = append(out[v.provider], v)
	}
	require.NoError(t, sc.Err())
	return out
}

// signedPreset is a provider's verifying preset with the clock at now.
func signedPreset(provider string, now time.Time, secrets ...string) KeyFunc {
	clock := func() time.Time { return now }
	switch provider {
	case "stripe":
		return withSignature(stripeSignature(secrets, clock), Stripe())
	case "github":
		return GitHub(secrets...)
	case "shopify":
		return Shopify(secrets...)
	case "standard":
		return withSignature(standardWebhooksSignature(secrets, clock), StandardWebhooks("billing"))
	}
	panic("no preset " + provider)
}

// signatureHeaders are the headers a delivery of v carries: its signature
// (as sig) and its event id.
func signatureHeaders(v vector, sig string) http.Header {
	h := http.Header{}
	set := func(k, val string) {
		if val != "" {
			h.Set(k, val)
		}
	}
	switch v.provider {
	case "stripe":
		set("Stripe-Signature", sig)
	case "github":
		set("X-Hub-Signature-256", sig)
		h.Set("X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
	case "shopify":
		set("X-Shopify-Hmac-Sha256", sig)
		h.Set("X-Shopify-Event-Id", "98880550-7158-44d4-b7cd-2c97c8a091b5")
	case "standard":
		h.Set("Webhook-Id", v.id)
		h.Set("Webhook-Timestamp", strconv.FormatInt(v.ts.Unix(), 10))
		set("Webhook-Signature", sig)
	}
	return h
}

func deliver(kf KeyFunc, h http.Header, body []byte) (Key, error) {
	r := httptest.NewRequest(http.MethodPost, "/webhooks/x", strings.NewReader(string(body)))
	r.Header = h
	return kf(r, body)
}

func TestVerifyingPresetsAgainstOpenSSLVectors(t *testing.T) {
	all := loadVectors(t)
	for _, provider := range []string{"stripe", "github", "shopify", "standard"} {
		vs := all[provider]
		require.GreaterOrEqual(t, len(vs), 2, "%s: an old and a new secret", provider)
		old, cur := vs[len(vs)-2], vs[len(vs)-1] // GitHub's first is the example of its docs
		at := old.ts                             // zero for the schemes without a timestamp
		t.Run(provider, func(t *testing.T) {
			t.Run("a valid signature yields the key", func(t *testing.T) {
				for _, v := range vs {
					k, err := deliver(signedPreset(provider, at, v.secret), signatureHeaders(v, v.signature), v.body)
					require.NoError(t, err)
					assert.NotEmpty(t, k.EventID)
				}
			})
			t.Run("during a rotation both secrets verify", func(t *testing.T) {
				kf := signedPreset(provider, at, cur.secret, old.secret)
				for _, v := range []vector{old, cur} {
					_, err := deliver(kf, signatureHeaders(v, v.signature), v.body)
					assert.NoError(t, err, "signed with %s", v.secret)
				}
			})
			t.Run("a wrong secret is refused", func(t *testing.T) {
				_, err := deliver(signedPreset(provider, at, cur.secret), signatureHeaders(old, old.signature), old.body)
				assert.ErrorIs(t, err, ErrSignature)
			})
			t.Run("a tampered body is refused", func(t *testing.T) {
				for _, i := range []int{0, len(old.body) / 2, len(old.body) - 1} {
					body := append([]byte(nil), old.body...)
					body[i] ^= 0x01
					_, err := deliver(signedPreset(provider, at, old.secret), signatureHeaders(old, old.signature), body)
					assert.ErrorIs(t, err, ErrSignature, "byte %d flipped", i)
				}
				_, err := deliver(signedPreset(provider, at, old.secret), signatureHeaders(old, old.signature), append(old.body, ' '))
				assert.ErrorIs(t, err, ErrSignature, "a byte appended")
			})
			t.Run("a missing or malformed signature is refused", func(t *testing.T) {
				kf := signedPreset(provider, at, old.secret)
				for _, sig := range malformed(old) {
					_, err := deliver(kf, signatureHeaders(old, sig), old.body)
					assert.ErrorIs(t, err, ErrSignature, "signature %q", sig)
				}
				h := signatureHeaders(old, old.signature)
				for name := range h {
					if strings.Contains(strings.ToLower(name), "sig") || strings.Contains(strings.ToLower(name), "hmac") {
						h.Add(name, old.signature)
					}
				}
				_, err := deliver(kf, h, old.body)
				assert.ErrorIs(t, err, ErrSignature, "the signature header sent twice")
			})
			switch provider {
			case "github", "shopify": // the id travels in a header the signature does not cover
				t.Run("a verified request without its key is a bad request, not a forgery", func(t *testing.T) {
					h := signatureHeaders(old, old.signature)
					h.Del("X-GitHub-Delivery")
					h.Del("X-Shopify-Event-Id")
					_, err := deliver(signedPreset(provider, at, old.secret), h, old.body)
					assert.ErrorIs(t, err, ErrNoKey)
					assert.NotErrorIs(t, err, ErrSignature)
				})
			case "standard": // the id is signed: without it, nothing verifies
				t.Run("a request without its signed id is refused as a forgery", func(t *testing.T) {
					h := signatureHeaders(old, old.signature)
					h.Del("Webhook-Id")
					_, err := deliver(signedPreset(provider, at, old.secret), h, old.body)
					assert.ErrorIs(t, err, ErrSignature)
				})
			case "stripe": // the id is the body's, which is signed
				t.Run("the key is the signed body's id", func(t *testing.T) {
					k, err := deliver(signedPreset(provider, at, old.secret), signatureHeaders(old, old.signature), old.body)
					require.NoError(t, err)
					assert.NotEmpty(t, k.EventID)
					assert.Contains(t, string(old.body), `"`+k.EventID+`"`)
				})
			}
		})
	}
}

// malformed returns signature header values for v's scheme that must not
// verify: missing, garbage, the wrong encoding, a truncated signature.
func malformed(v vector) []string {
	sigs := []string{"", "garbage", v.signature[:len(v.signature)-4]}
	switch v.provider {
	case "stripe":
		ts := strconv.FormatInt(v.ts.Unix(), 10)
		mac := v.signature[strings.Index(v.signature, "v1=")+3:]
		sigs = append(sigs, "t="+ts, "v1="+mac, "t=x,v1="+mac, "t="+ts+",v0="+mac, "t="+ts+",t="+ts+",v1="+mac, "t="+ts+",v1="+strings.ToUpper(mac[:10])+"zz")
	case "github":
		mac := strings.TrimPrefix(v.signature, "sha256=")
		sigs = append(sigs, mac, "sha1="+mac, "sha256="+mac[:62], "SHA256="+mac)
	case "shopify":
		sigs = append(sigs, "sha256="+v.signature, v.signature[:len(v.signature)-1])
	case "standard":
		b64 := strings.TrimPrefix(v.signature, "v1,")
		sigs = append(sigs, b64, "v1a,"+b64, "v2,"+b64, "v1,"+b64[:20], "v1 "+b64)
	}
	return sigs
}

func TestSignedTimestampsOutsideTheToleranceAreRefused(t *testing.T) {
	all := loadVectors(t)
	for provider, tolerance := range map[string]time.Duration{"stripe": stripeTolerance, "standard": standardWebhooksTolerance} {
		v := all[provider][0]
		for _, tc := range []struct {
			name string
			now  time.Time
			ok   bool
		}{
			{"signed just now", v.ts, true},
			{"signed at the edge of the tolerance", v.ts.Add(tolerance), true},
			{"signed a second too long ago (a replay)", v.ts.Add(tolerance + time.Second), false},
			{"signed an hour ago", v.ts.Add(time.Hour), false},
			{"signed ahead of the clock, within the tolerance", v.ts.Add(-tolerance), true},
			{"signed too far ahead of the clock", v.ts.Add(-tolerance - time.Second), false},
		} {
			t.Run(provider+": "+tc.name, func(t *testing.T) {
				_, err := deliver(signedPreset(provider, tc.now, v.secret), signatureHeaders(v, v.signature), v.body)
				if tc.ok {
					assert.NoError(t, err)
				} else {
					assert.ErrorIs(t, err, ErrSignature)
				}
			})
		}
	}
}

func TestSeveralSignaturesInOneHeader(t *testing.T) {
	all := loadVectors(t)
	st := all["stripe"]
	ts := strconv.FormatInt(st[0].ts.Unix(), 10)
	macOf := func(v vector) string { return v.signature[strings.Index(v.signature, "v1=")+3:] }
	// Stripe signs with every active secret while one is rolled: the new
	// secret's signature may come first.
	both := "t=" + ts + ",v1=" + macOf(st[1]) + ",v1=" + macOf(st[0]) + ",v0=00"
	_, err := deliver(signedPreset("stripe", st[0].ts, st[0].secret), signatureHeaders(st[0], both), st[0].body)
	assert.NoError(t, err)

	sw := all["standard"]
	both = sw[1].signature + " " + sw[0].signature
	_, err = deliver(signedPreset("standard", sw[0].ts, sw[0].secret), signatureHeaders(sw[0], both), sw[0].body)
	assert.NoError(t, err)
	_, err = deliver(signedPreset("standard", sw[0].ts, "whsec_"+strings.Repeat("A", 32)), signatureHeaders(sw[0], both), sw[0].body)
	assert.ErrorIs(t, err, ErrSignature)
}

func TestSvixHeaderNamesVerify(t *testing.T) {
	v := loadVectors(t)["standard"][0]
	h := http.Header{}
	h.Set("Svix-Id", v.id)
	h.Set("Svix-Timestamp", strconv.FormatInt(v.ts.Unix(), 10))
	h.Set("Svix-Signature", v.signature)
	k, err := deliver(signedPreset("standard", v.ts, v.secret), h, v.body)
	require.NoError(t, err)
	assert.Equal(t, v.id, k.EventID)

	h.Set("Svix-Id", "msg_other") // the id is signed
	_, err = deliver(signedPreset("standard", v.ts, v.secret), h, v.body)
	assert.ErrorIs(t, err, ErrSignature)
}

func TestUnusableSecretsPanicWhenThePresetIsBuilt(t *testing.T) {
	// An unset environment variable must not leave an endpoint unverified.
	assert.PanicsWithValue(t, "idem: Stripe: signing secret 1 of 1 is empty", func() { Stripe("") })
	assert.Panics(t, func() { GitHub("s", "") })
	assert.Panics(t, func() { Shopify("") })
	assert.Panics(t, func() { StandardWebhooks("billing", "") })
	assert.Panics(t, func() { StandardWebhooks("billing", "whsec_not base64!") })
	assert.NotPanics(t, func() { StandardWebhooks("billing", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw") }, "the prefix is optional")
}

func TestSignatureErrorsAre401WithTheirOwnProblemType(t *testing.T) {
	for _, err := range []error{
		ErrSignature,
		fmt.Errorf("%w: header Stripe-Signature is missing", ErrSignature),
		fmt.Errorf("my verifier: %w", ErrSignature), // a custom KeyFunc's
	} {
		p := keyProblem(err)
		assert.Equal(t, http.StatusUnauthorized, p.Status, "%v", err)
		assert.Equal(t, problemBase+"invalid-signature", p.Type)
		assert.Equal(t, "Invalid webhook signature", p.Title)
		assert.ErrorIs(t, p.Err, ErrSignature)
	}
	assert.Equal(t, "webhook signature does not verify: header Stripe-Signature is missing",
		keyProblem(fmt.Errorf("%w: header Stripe-Signature is missing", ErrSignature)).Detail)
}

// FuzzSignatureHeaders: whatever the signature headers and body, a
// verifier never panics, refuses with ErrSignature, and accepts only the
// body (and the timestamp and id) that the secret signed.
func FuzzSignatureHeaders(f *testing.F) {
	all := loadVectors(f)
	providers := []string{"stripe", "github", "shopify", "standard"}
	for i, p := range providers {
		v := all[p][len(all[p])-1]
		ts := strconv.FormatInt(v.ts.Unix(), 10)
		f.Add(uint8(i), v.signature, ts, v.id, v.body)
		f.Add(uint8(i), v.signature+" "+v.signature, ts, v.id, v.body)
		f.Add(uint8(i), strings.Repeat(v.signature+",", 50), "+"+ts, v.id+".", append(v.body, 0))
		f.Add(uint8(i), "", "", "", []byte(nil))
	}
	f.Fuzz(func(t *testing.T, which uint8, sig, ts, id string, body []byte) {
		p := providers[int(which)%len(providers)]
		v := all[p][len(all[p])-1]
		kf := signedPreset(p, v.ts, v.secret)
		h := signatureHeaders(v, sig)
		if p == "standard" {
			h["Webhook-Timestamp"] = []string{ts}
			h["Webhook-Id"] = []string{id}
		}
		_, err := deliver(kf, h, body)
		switch {
		case err != nil:
			if !errors.Is(err, ErrSignature) && !errors.Is(err, ErrNoKey) && !errors.Is(err, ErrInvalidKey) && !errors.Is(err, ErrBadBody) {
				t.Fatalf("%s: an error that wraps no sentinel: %v", p, err)
			}
			if strings.Contains(err.Error(), v.secret) {
				t.Fatalf("%s: the error shows the secret: %v", p, err)
			}
		case !bytes.Equal(body, v.body):
			t.Fatalf("%s accepted a body the secret did not sign: %q", p, body)
		case p == "standard" && (id != v.id || ts != strconv.FormatInt(v.ts.Unix(), 10)):
			t.Fatalf("standard accepted id %q, timestamp %q; signed: %q, %d", id, ts, v.id, v.ts.Unix())
		}
	})
}

func TestWithSourceKeepsVerification(t *testing.T) {
	v := loadVectors(t)["github"][1]
	kf := GitHub(v.secret).WithSource("github")
	k, err := deliver(kf, signatureHeaders(v, v.signature), v.body)
	require.NoError(t, err)
	assert.Equal(t, "github", k.Source)
	_, err = deliver(kf, signatureHeaders(v, v.signature), append(bytes.Clone(v.body), ' '))
	assert.ErrorIs(t, err, ErrSignature)
}

// A header of many signatures is refused after the eighth, in one pass over
// it: a 1 MiB Stripe-Signature of commas or v1 items, or a webhook-signature
// of a hundred thousand items, allocates a few KiB, not memory per item.
func TestHeadersOfManySignaturesAreRefusedCheaply(t *testing.T) {
	all := loadVectors(t)
	st, sw := all["stripe"][0], all["standard"][0]
	ts := strconv.FormatInt(st.ts.Unix(), 10)
	mac := st.signature[strings.Index(st.signature, "v1=")+3:]
	nine := "t=" + ts + strings.Repeat(",v1=00", 8) + ",v1=" + mac
	_, err := deliver(signedPreset("stripe", st.ts, st.secret), signatureHeaders(st, nine), st.body)
	assert.ErrorContains(t, err, "more than 8 signatures")
	for name, tc := range map[string]struct {
		v      vector
		header string
	}{
		"Stripe-Signature of commas":      {st, "t=" + ts + strings.Repeat(",", 1<<20) + "v1=00"},
		"Stripe-Signature of v1 items":    {st, "t=" + ts + strings.Repeat(",v1=", 1<<18)},
		"webhook-signature of many items": {sw, strings.Repeat("v1,AAAA ", 1<<17)},
	} {
		kf := signedPreset(map[bool]string{true: "stripe", false: "standard"}[tc.v.provider == "stripe"], tc.v.ts, tc.v.secret)
		h := signatureHeaders(tc.v, tc.header)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := deliver(kf, h, tc.v.body)
		runtime.ReadMemStats(&after)
		assert.ErrorIs(t, err, ErrSignature, name)
		assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<10), "%s: bytes allocated", name)
	}
}

// An empty list of secrets, as strings.Fields gives for an unset variable,
// is not the call without secrets: it panics rather than verify nothing.
func TestAnEmptyListOfSecretsPanics(t *testing.T) {
	unset := strings.Fields("")
	assert.PanicsWithValue(t, "idem: Stripe: the list of signing secrets is empty", func() { Stripe(unset...) })
	assert.Panics(t, func() { GitHub(unset...) })
	assert.Panics(t, func() { Shopify(unset...) })
	assert.Panics(t, func() { StandardWebhooks("billing", unset...) })
	assert.NotPanics(t, func() { Stripe() }, "no secrets: the unverified preset")
}
