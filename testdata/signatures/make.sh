#!/usr/bin/env bash
# Regenerates vectors.tsv: GitHub, Shopify, Stripe and Standard Webhooks
# signatures over the fixed bodies of this folder, computed by OpenSSL, not
# by idem, so that verify_test.go checks idem's verifiers against another
# implementation.
# Columns: provider, secret, body file, signature header value, and for the
# schemes that sign a timestamp (and an id) with the body, the timestamp
# (and the id). The bodies are fixed files; the timestamp is fixed, so tests
# set the verifier's clock to it.
set -euo pipefail
cd "$(dirname "$0")"

hexmac() { openssl dgst -sha256 -hmac "$1" -binary < "$2" | od -An -v -tx1 | tr -d ' \n'; }
b64mac() { openssl dgst -sha256 -hmac "$1" -binary < "$2" | openssl base64 -A; }
# The Standard Webhooks key is the base64 after "whsec_", decoded.
whkey() { printf '%s' "${1#whsec_}" | openssl base64 -d -A | od -An -v -tx1 | tr -d ' \n'; }
ts=1767225600 # 2026-01-01T00:00:00Z

{
  # GitHub's own example (docs: "Validating webhook deliveries"): the
  # signature must be 757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17.
  printf 'github\t%s\t%s\tsha256=%s\n' "It's a Secret to Everybody" hello.txt "$(hexmac "It's a Secret to Everybody" hello.txt)"
  for secret in gh_old_secret_4f1c gh_new_secret_9a27; do
    printf 'github\t%s\t%s\tsha256=%s\n' "$secret" github-push.json "$(hexmac "$secret" github-push.json)"
  done
  for secret in shpss_old_0d5e81 shpss_new_7b3c22; do
    printf 'shopify\t%s\t%s\t%s\n' "$secret" shopify-order.json "$(b64mac "$secret" shopify-order.json)"
  done
  for secret in whsec_old_secret_QDZ6 whsec_new_secret_K7Pa; do
    mac=$({ printf '%s.' "$ts"; cat stripe-event.json; } | openssl dgst -sha256 -hmac "$secret" -binary | od -An -v -tx1 | tr -d ' \n')
    printf 'stripe\t%s\t%s\tt=%s,v1=%s\t%s\n' "$secret" stripe-event.json "$ts" "$mac" "$ts"
  done
  id=msg_2KWPBgLlAfxdpx2AI54pPJ85f4W
  for secret in whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD; do
    sig=$({ printf '%s.%s.' "$id" "$ts"; cat standard-event.json; } | openssl dgst -sha256 -mac HMAC -macopt "hexkey:$(whkey "$secret")" -binary | openssl base64 -A)
    printf 'standard\t%s\t%s\tv1,%s\t%s\t%s\n' "$secret" standard-event.json "$sig" "$ts" "$id"
  done
} > vectors.tsv
