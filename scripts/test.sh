#!/usr/bin/env bash
# The test command of the README: every module's tests, with the race
# detector, against the PostgreSQL at DATABASE_URL (default: the local
# server, postgres@127.0.0.1:5432, trust auth). Fails on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== root module: go test -race (database/sql adapter)"
go test -race -count=1 ./...

echo "== root module: the behaviour suite on the pgx adapter (IDEM_ADAPTER=pgx)"
IDEM_ADAPTER=pgx go test -race -count=1 .

# The behaviour suite again on partitioned tables (docs/partitioning.md):
# every test table range-partitioned by day, on both adapters.
echo "== root module: the behaviour suite on partitioned tables (IDEM_LAYOUT=partitioned), both adapters"
for a in sql pgx; do
  IDEM_ADAPTER=$a IDEM_LAYOUT=partitioned go test -race -count=1 .
done

# The waiting-duplicates cases depend on timing: run them repeatedly, on
# both adapters, so that a lucky pass cannot hide a race.
echo "== waiting duplicates, 5 times on each adapter"
for a in sql pgx; do
  IDEM_ADAPTER=$a go test -race -count=5 -run 'TestWaitingDuplicatesOfAFailedOriginal|TestTakeoverRunsWithTheOriginalsSettings|TestHotKeyDoesNotStarveOtherEvents' .
done

echo "== root module: every benchmark once (-benchtime 1x), so they cannot rot"
go test -run '^$' -bench . -benchtime 1x -count=1 . >/dev/null

if [ -f examples/go.mod ]; then
  echo "== examples module: build and go test -race"
  (cd examples && go build ./... && go test -race -count=1 ./...)
fi

if [ -f idemgin/go.mod ]; then
  echo "== idemgin module (gin adapter): go test -race"
  (cd idemgin && go test -race -count=1 ./...)
fi

if [ -f idemprom/go.mod ]; then
  echo "== idemprom module (Prometheus adapter): go test -race"
  (cd idemprom && go test -race -count=1 ./...)
fi

# Releases (RELEASING.md): what each public module's zip would hold, from
# the committed files, and the publish rehearsal.
echo "== module zips: only source (no binary, no non-script executable, no file over 1 MiB)"
(cd internal/tools/modcheck && go test -count=1 ./... && go run . zips)

echo "== publish rehearsal: every public module installed as a new user would, as if HEAD were tagged"
bash scripts/publish-rehearsal.sh

if [ -f bench/go.mod ]; then
  echo "== bench module: build, test, and a short load run"
  (cd bench && go build ./... && go test -count=1 ./...)
  [ -f scripts/bench-smoke.sh ] && bash scripts/bench-smoke.sh
fi

# Time-bounded fuzzing of every parser of untrusted input.
[ -f scripts/fuzz.sh ] && bash scripts/fuzz.sh

# The integration suite again, through PgBouncer in transaction mode.
[ -f scripts/test-pgbouncer.sh ] && bash scripts/test-pgbouncer.sh

echo "== all tests passed"
