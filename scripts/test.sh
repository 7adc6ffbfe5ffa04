#!/usr/bin/env bash
# The test command of the README: every module's tests, with the race
# detector, against the PostgreSQL at DATABASE_URL (default: the local
# server, postgres@127.0.0.1:5432, trust auth). Fails on any failure.
#
# The passes that do not contend run side by side (scripts/steps.sh), and
# each step prints its seconds; the table at the end shows what each costs.
# On an idle 2-core machine the whole command took 315 s on 2 December 2026
# with Go's build cache warm, and about 10 minutes the first time on a new
# machine (every module compiled, the publish rehearsal's builds too): keep
# it under 10. The fuzzing step builds its test binary once (fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh

# Tests that do not depend on the adapter or the table's layout (the docs'
# code compiles, the guarantees table names real tests) run in the first
# pass only.
once='^(TestDocCodeCompiles|TestGuaranteesNameRealTests)$'

root_sql() { go test -race -count=1 ./...; }
root_pgx() { IDEM_ADAPTER=pgx go test -race -count=1 -skip "$once" .; }
# The behaviour suite again on partitioned tables (docs/partitioning.md):
# every test table range-partitioned by day, on both adapters (and the
# operations package's own tests, which use no adapter, once).
partitioned() { IDEM_ADAPTER=$1 IDEM_LAYOUT=partitioned go test -race -count=1 -skip "$once" . "${@:2}"; }
# The waiting-duplicates cases depend on timing: run them again, on both
# adapters, so that a lucky pass cannot hide a race.
waiting() {
  IDEM_ADAPTER=$1 go test -race -count=3 \
    -run 'TestWaitingDuplicatesOfAFailedOriginal|TestTakeoverRunsWithTheOriginalsSettings|TestHotKeyDoesNotStarveOtherEvents' .
}
# Every benchmark once (-benchtime 1x), so they cannot rot.
# Their results are not shown (the numbers mean nothing at 1x); a failure is.
benchmarks() {
  local out
  out=$(go test -run '^$' -bench . -benchtime 1x -count=1 . 2>&1) || { echo "$out" | grep -v '^Benchmark'; return 1; }
  echo "$out" | tail -n 1
}
examples() { cd examples && go build ./... && go test -race -count=1 ./...; }
module() { cd "$1" && go test -race -count=1 ./...; }
providertest() { cd internal/providertest && go vet ./... && go test -race -count=1 ./...; }
zips() { cd internal/tools/modcheck && go test -count=1 ./... && go run . zips; }
bench_module() {
  cd bench && go build ./... && go test -count=1 ./...
  cd .. && bash scripts/bench-smoke.sh
}

together "root module, database/sql adapter: go test -race ./..." root_sql \
  -- "root module, pgx adapter (IDEM_ADAPTER=pgx)" root_pgx
together "partitioned tables, database/sql adapter" partitioned sql ./idemops \
  -- "partitioned tables, pgx adapter" partitioned pgx \
  -- "waiting duplicates, 3 times, database/sql adapter" waiting sql \
  -- "waiting duplicates, 3 times, pgx adapter" waiting pgx

modules=("every benchmark once" benchmarks --)
[ -f examples/go.mod ] && modules+=("examples module: build and go test -race" examples --)
for m in idemgin idemprom idemui idemgrpc; do
  [ -f $m/go.mod ] && modules+=("$m module: go test -race" module $m --)
done
# The modules run in three groups, not all at once: seventeen test
# processes side by side on two cores starved the timing-sensitive ones
# (a browser, broker storms, a failover).
modules+=("module zips: only source (no binary, no non-script executable, no file over 1 MiB)" zips --)
together "${modules[@]}"
modules=()
for m in idemotel idemnats idemrabbitmq idemwatermill; do
  [ -f $m/go.mod ] && modules+=("$m module: go test -race" module $m --)
done
# The verifying presets against the providers' own signing libraries
# (stripe-go, the Standard Webhooks library): a test-only module.
# The operator UI (idemui) in headless Chromium (Debian's chromium package;
# .ci/run installs it): a test-only module, so chromedp is a requirement of
# no published module. Screenshots of the pages go to $IDEM_SCREENSHOTS, or
# a new directory under $TMPDIR.
browser() {
  local shots=${IDEM_SCREENSHOTS:-$(mktemp -d "${TMPDIR:-/tmp}/idemui-screenshots.XXXXXX")}
  echo "screenshots of the pages: $shots"
  cd internal/browsertest && go vet ./... && IDEM_SCREENSHOTS=$shots go test -race -count=1 ./...
}
together "${modules[@]}"
modules=()
[ -f internal/browsertest/go.mod ] && modules+=("operator UI in headless Chromium: go test" browser --)
# A Connect handler behind the HTTP middleware, called by connect's and
# grpc-go's clients (Connect, gRPC, gRPC-Web): a test-only module, so
# connect is a requirement of no published module.
connecttest() { cd internal/connecttest && go vet ./... && go test -race -count=1 ./...; }
[ -f internal/connecttest/go.mod ] && modules+=("connecttest module (Connect, gRPC and gRPC-Web through the HTTP middleware): go vet + go test -race" connecttest --)
# idem under pg_auto_failover (internal/hatest, build tag hatest): a monitor
# and two nodes as the postgres user on free ports, a switchover and a kill
# of the primary mid-storm, both adapters (.ci/run installs pg_auto_failover).
hatest() { go test -tags hatest -race -count=1 -timeout 10m ./internal/hatest; }
modules+=("pg_auto_failover: a switchover and a kill of the primary mid-storm (go test -tags hatest)" hatest --)
[ -f internal/providertest/go.mod ] && modules+=("providertest module: go vet + go test -race" providertest --)
[ -f bench/go.mod ] && modules+=("bench module: build, test, and a short load run" bench_module --)
# Releases (RELEASING.md): what each public module's zip would hold, from
# the committed files, and the publish rehearsal.
modules+=("publish rehearsal: every public module installed as a new user would, as if HEAD were tagged" bash scripts/publish-rehearsal.sh --)
# Time-bounded fuzzing of every parser of untrusted input.
modules+=("fuzzing" bash scripts/fuzz.sh --)
together "${modules[@]}"

# The integration suite again, through PgBouncer in transaction mode.
step "PgBouncer passes" bash scripts/test-pgbouncer.sh

steps_summary
echo "== all tests passed"
