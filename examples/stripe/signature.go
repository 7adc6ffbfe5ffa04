package main

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pgidem/idem"
)

// signatureTolerance is how far a signature's timestamp may be from now,
// either way: Stripe's libraries default to five minutes. It bounds how long
// a captured request can be replayed by someone else.
const signatureTolerance = 5 * time.Minute

var (
	errNoSignature  = errors.New("no valid Stripe-Signature header")
	errStale        = errors.New("the signature's timestamp is outside the tolerance")
	errBadSignature = errors.New("no v1 signature matches the payload")
)

// verifySignature lets through only requests that carry a valid
// Stripe-Signature for secret, with the body restored for what follows.
// Others get 400 and reach neither the idempotency middleware nor the
// handler: nothing is claimed for them.
func verifySignature(secret string, now func() time.Time) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			payload, err := io.ReadAll(http.MaxBytesReader(w, r.Body, idem.DefaultMaxBodyBytes))
			var tooLarge *http.MaxBytesError
			switch {
			case errors.As(err, &tooLarge):
				http.Error(w, "request body too large", http.StatusRequestEntityTooLarge)
				return
			case err != nil:
				http.Error(w, "request body unreadable", http.StatusBadRequest)
				return
			}
			if err := checkSignature(r.Header.Get("Stripe-Signature"), payload, secret, now()); err != nil {
				http.Error(w, "invalid Stripe signature: "+err.Error(), http.StatusBadRequest)
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(payload))
			next.ServeHTTP(w, r)
		})
	}
}

// checkSignature verifies a Stripe-Signature header, as Stripe documents it:
// "t=<unix time>,v1=<hex>[,v1=<hex>...]" (several v1 while a secret is being
// rolled; other schemes such as v0 are ignored), where each v1 is the
// HMAC-SHA256, keyed with the endpoint's secret, of "<t>.<payload>".
func checkSignature(header string, payload []byte, secret string, now time.Time) error {
	var (
		ts   int64
		seen bool
		sigs [][]byte
	)
	for _, item := range strings.Split(header, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok {
			continue
		}
		switch k {
		case "t":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || seen {
				return errNoSignature
			}
			ts, seen = n, true
		case "v1":
			if sig, err := hex.DecodeString(v); err == nil {
				sigs = append(sigs, sig)
			}
		}
	}
	if !seen || len(sigs) == 0 {
		return errNoSignature
	}
	if d := now.Sub(time.Unix(ts, 0)); d > signatureTolerance || d < -signatureTolerance {
		return errStale
	}
	want := signatureMAC(payload, secret, ts)
	for _, sig := range sigs {
		if hmac.Equal(sig, want) {
			return nil
		}
	}
	return errBadSignature
}

// signatureMAC is the v1 signature of payload signed at unix time ts.
func signatureMAC(payload []byte, secret string, ts int64) []byte {
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(strconv.FormatInt(ts, 10)))
	mac.Write([]byte{'.'})
	mac.Write(payload)
	return mac.Sum(nil)
}
