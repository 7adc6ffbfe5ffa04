package idem

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// How far a signed timestamp may be from the clock, either way, before a
// delivery is refused as a replay: Stripe's libraries default to 300 s, the
// Standard Webhooks specification says 5 minutes.
const (
	stripeTolerance           = 300 * time.Second
	standardWebhooksTolerance = 5 * time.Minute
)

// verifier checks the provider's signature of a request over the exact body
// bytes received. It returns nil when one of the endpoint's secrets signed
// them, and otherwise an error that wraps ErrSignature.
type verifier func(r *http.Request, body []byte) error

// withSignature returns f behind v: the key is read only from a request
// whose signature verifies, so a forged delivery never claims an event id.
// A nil v (a preset built without secrets) leaves f as it is.
func withSignature(v verifier, f KeyFunc) KeyFunc {
	if v == nil {
		return f
	}
	return func(r *http.Request, body []byte) (Key, error) {
		if err := v(r, body); err != nil {
			return Key{}, err
		}
		return f(r, body)
	}
}

// macKeys returns the HMAC keys of a preset's secrets, decoded by decode;
// nil when there are none (the preset does not verify). An empty secret, or
// one decode refuses, is a configuration error, caught when the KeyFunc is
// built rather than by answering every delivery 401: an unset environment
// variable must not turn verification off.
func macKeys(fn string, secrets []string, decode func(string) ([]byte, error)) [][]byte {
	if secrets != nil && len(secrets) == 0 {
		// Stripe(strings.Fields(os.Getenv("UNSET"))...): an empty list,
		// not the call without secrets.
		panic(fmt.Sprintf("idem: %s: the list of signing secrets is empty", fn))
	}
	var keys [][]byte
	for i, s := range secrets {
		if s == "" {
			panic(fmt.Sprintf("idem: %s: signing secret %d of %d is empty", fn, i+1, len(secrets)))
		}
		k, err := decode(s)
		if err != nil {
			panic(fmt.Sprintf("idem: %s: signing secret %d of %d: %v", fn, i+1, len(secrets), err))
		}
		keys = append(keys, k)
	}
	return keys
}

// asGiven uses a secret's bytes as the HMAC key, as Stripe, GitHub and
// Shopify do.
func asGiven(s string) ([]byte, error) { return []byte(s), nil }

// matches reports whether one of the signatures is the HMAC-SHA256, under
// one of keys, of the concatenated parts, comparing in constant time.
func matches(keys [][]byte, sigs [][]byte, parts ...[]byte) bool {
	for _, k := range keys {
		mac := hmac.New(sha256.New, k)
		for _, p := range parts {
			mac.Write(p)
		}
		sum := mac.Sum(nil)
		for _, s := range sigs {
			if hmac.Equal(sum, s) {
				return true
			}
		}
	}
	return false
}

// signatureHeader returns the one value of the signature header name.
func signatureHeader(r *http.Request, name string) (string, error) {
	return oneHeader(r, name, ErrSignature, ErrSignature)
}

// headerSignature returns nil without keys (the preset does not verify),
// and otherwise a verifier that hands the one value of the header name to
// check.
func headerSignature(keys [][]byte, name string, check func(h string, body []byte) error) verifier {
	if keys == nil {
		return nil
	}
	return func(r *http.Request, body []byte) error {
		h, err := signatureHeader(r, name)
		if err != nil {
			return err
		}
		return check(h, body)
	}
}

// noMatch is the error for well-formed signatures that none of the secrets
// made: a forgery, a tampered body, or a secret the endpoint does not have.
func noMatch(name string) error {
	return fmt.Errorf("%w: no signature in %s matches the endpoint's secret", ErrSignature, name)
}

// checkTime refuses a signed Unix timestamp further than tolerance from now,
// in either direction: a captured delivery cannot be replayed later.
func checkTime(name, ts string, now time.Time, tolerance time.Duration) error {
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return fmt.Errorf("%w: header %s has no valid timestamp", ErrSignature, name)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: the signed timestamp is more than %v away from the receiver's clock", ErrSignature, tolerance)
	}
	return nil
}

// maxSignatures is the most signatures a header may carry: a sender signs
// with one secret, two or three while it rotates them. More are refused
// before any is checked, so a header of thousands costs one pass over it.
const maxSignatures = 8

func tooManySignatures(name string) error {
	return fmt.Errorf("%w: header %s has more than %d signatures", ErrSignature, name, maxSignatures)
}

// stripeSignature verifies Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]
// over "<t>." and the body, with the endpoint secrets used as given.
func stripeSignature(secrets []string, now func() time.Time) verifier {
	const name = "Stripe-Signature"
	keys := macKeys("Stripe", secrets, asGiven)
	return headerSignature(keys, name, func(h string, body []byte) error {
		var ts string
		var sigs [][]byte
		for rest := h; rest != ""; {
			var item string
			item, rest, _ = strings.Cut(rest, ",")
			k, v, _ := strings.Cut(strings.TrimSpace(item), "=")
			switch k {
			case "t":
				if ts != "" {
					return fmt.Errorf("%w: header %s has two timestamps", ErrSignature, name)
				}
				ts = v
			case "v1":
				if len(sigs) == maxSignatures {
					return tooManySignatures(name)
				}
				if s, err := hex.DecodeString(v); err == nil {
					sigs = append(sigs, s)
				}
			}
		}
		if err := checkTime(name, ts, now(), stripeTolerance); err != nil {
			return err
		}
		if len(sigs) == 0 {
			return fmt.Errorf("%w: header %s has no v1 signature", ErrSignature, name)
		}
		if !matches(keys, sigs, []byte(ts), []byte("."), body) {
			return noMatch(name)
		}
		return nil
	})
}

// bodySignature verifies a header that carries the HMAC-SHA256 of the body
// alone, after prefix and in the given encoding (GitHub, Shopify).
func bodySignature(fn, name, prefix string, secrets []string, decode func(string) ([]byte, error)) verifier {
	keys := macKeys(fn, secrets, asGiven)
	return headerSignature(keys, name, func(h string, body []byte) error {
		v, ok := strings.CutPrefix(h, prefix)
		sig, err := decode(v)
		if !ok || err != nil || len(sig) != sha256.Size {
			return fmt.Errorf("%w: header %s is malformed", ErrSignature, name)
		}
		if !matches(keys, [][]byte{sig}, body) {
			return noMatch(name)
		}
		return nil
	})
}

// githubSignature verifies X-Hub-Signature-256: sha256=<hex> over the body.
func githubSignature(secrets []string) verifier {
	return bodySignature("GitHub", "X-Hub-Signature-256", "sha256=", secrets, hex.DecodeString)
}

// shopifySignature verifies X-Shopify-Hmac-Sha256: <base64> over the body.
func shopifySignature(secrets []string) verifier {
	return bodySignature("Shopify", "X-Shopify-Hmac-Sha256", "", secrets, base64.StdEncoding.DecodeString)
}

// standardWebhooksSecret decodes a Standard Webhooks secret: the base64
// after "whsec_" (or the whole secret, without the prefix) is the HMAC key.
func standardWebhooksSecret(s string) ([]byte, error) {
	k, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
	if err != nil || len(k) == 0 {
		return nil, fmt.Errorf("not a whsec_<base64> secret")
	}
	return k, nil
}

// standardWebhooksSignature verifies webhook-signature: v1,<base64>
// [v1,<base64> ...] over "<webhook-id>.<webhook-timestamp>." and the body
// (svix-signature, svix-id and svix-timestamp when webhook-id is absent, as
// StandardWebhooks reads the id).
func standardWebhooksSignature(secrets []string, now func() time.Time) verifier {
	keys := macKeys("StandardWebhooks", secrets, standardWebhooksSecret)
	if keys == nil {
		return nil
	}
	return func(r *http.Request, body []byte) error {
		prefix := "Webhook-"
		if len(r.Header.Values("Webhook-Id")) == 0 {
			prefix = "Svix-"
		}
		var vals [3]string
		for i, name := range []string{"Id", "Timestamp", "Signature"} {
			v, err := signatureHeader(r, prefix+name)
			if err != nil {
				return err
			}
			vals[i] = v
		}
		id, ts, h := vals[0], vals[1], vals[2]
		name := prefix + "Signature"
		if err := checkTime(prefix+"Timestamp", ts, now(), standardWebhooksTolerance); err != nil {
			return err
		}
		var sigs [][]byte
		for rest := strings.TrimSpace(h); rest != ""; rest = strings.TrimLeft(rest, " ") {
			var item string
			item, rest, _ = strings.Cut(rest, " ")
			if v, ok := strings.CutPrefix(item, "v1,"); ok {
				if len(sigs) == maxSignatures {
					return tooManySignatures(name)
				}
				if s, err := base64.StdEncoding.DecodeString(v); err == nil {
					sigs = append(sigs, s)
				}
			}
		}
		if len(sigs) == 0 {
			return fmt.Errorf("%w: header %s has no v1 signature", ErrSignature, name)
		}
		if !matches(keys, sigs, []byte(id), []byte("."), []byte(ts), []byte("."), body) {
			return noMatch(name)
		}
		return nil
	}
}
