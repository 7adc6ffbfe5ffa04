#!/usr/bin/env bash
# Builds the load tool (bench/cmd/idemload) and runs it for a few seconds,
# so that it cannot rot: every receiver must answer every request right and
# run each event exactly once. No throughput is asserted. Needs PostgreSQL
# (DATABASE_URL, default the local server); the Fiber+Redis peer joins when
# Redis answers on 127.0.0.1:6379.
set -euo pipefail
cd "$(dirname "$0")/../bench"

mkdir -p bin
go build -o bin/idemload ./cmd/idemload
# 2 mixes x 5 receivers x 300ms, plus warm-up and seeding: about 5 s.
bin/idemload -duration 300ms -rounds 1 -warmup 50ms -keys 50 -c 8 -pool 4 -mix new,dup
# The JSON report must parse, and a mixed workload must work too.
bin/idemload -duration 200ms -rounds 1 -warmup 50ms -keys 20 -c 4 -pool 2 -mix 0.5 \
  -receivers idem,inline,idem-otel,idempgx-otel -json > bin/smoke.json
grep -q '"ok": true' bin/smoke.json
echo "bench-smoke: ok"
