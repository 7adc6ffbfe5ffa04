#!/usr/bin/env bash
# Runs the root module's benchmarks (bench_test.go) against PostgreSQL and
# compares, with benchstat, each implementation beside the inline baseline
# (the seed's SQL written by hand): idem, idem-nocache, inline, bare.
#
#   scripts/bench.sh                  # 6 rounds, every benchmark
#   COUNT=10 BENCH=NoopDriver scripts/bench.sh
#   scripts/bench.sh OLD.txt          # also compare this run with an earlier one
#
# The rounds are separate `go test -count 1` runs, so that the impls take
# turns (A B C A B C ...) and a burst of load on the machine falls on all of
# them alike; go test -count N would run each impl N times in a row.
# Each round runs with BENCH_ROUND set to its number, so that a benchmark
# can rotate the order of its variants (BenchmarkPartitionedTable does).
# Environment: COUNT (rounds, default 6: benchstat needs 6 samples for a
# confidence interval), BENCH (a -bench regexp, default .),
# BENCHTIME (default 1s), OUT (where the raw results go, default
# bench/bin/bench-<time>.txt, which git ignores), DATABASE_URL (as for the
# tests). The benchmarks create their own database and fail, never skip,
# without PostgreSQL. Numbers on a shared 2-core machine are noisy: compare
# ratios from one run, and look at benchstat's ± column.
set -euo pipefail
cd "$(dirname "$0")/.."

COUNT=${COUNT:-6}
BENCH=${BENCH:-.}
BENCHTIME=${BENCHTIME:-1s}
mkdir -p bench/bin
OUT=${OUT:-bench/bin/bench-$(date +%Y%m%d-%H%M%S).txt}
# Pinned: the newest golang.org/x/perf when this script was written.
BENCHSTAT=(go run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da)

go test -c -o bench/bin/idem.test .
: > "$OUT"
for i in $(seq 1 "$COUNT"); do
  echo "== round $i/$COUNT: -bench '$BENCH' -benchtime $BENCHTIME -> $OUT"
  BENCH_ROUND=$i bench/bin/idem.test -test.run '^$' -test.bench "$BENCH" -test.benchmem -test.count 1 \
    -test.benchtime "$BENCHTIME" -test.timeout 60m | tee -a "$OUT"
done

echo
echo "== benchstat: each impl against inline (the seed's SQL by hand)"
"${BENCHSTAT[@]}" -col '/impl@(inline idem idem-nocache bare)' -row '.name /path' "$OUT"

if [ $# -gt 0 ]; then
  echo
  echo "== benchstat: $1 (old) against $OUT (new)"
  "${BENCHSTAT[@]}" "$1" "$OUT"
fi
