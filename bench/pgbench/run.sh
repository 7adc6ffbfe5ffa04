#!/usr/bin/env bash
# The SQL-only comparison behind docs/performance.md's "What limits the
# speed": each path's statements, without Go or HTTP, through pgbench (8
# clients by default), in interleaved rounds. Creates its own database and drops
# it at the end.
#
#   bench/pgbench/run.sh            # 3 rounds of 8 s per script
#   ROUNDS=5 SECONDS_EACH=10 CLIENTS=16 bench/pgbench/run.sh
#   SCHEMA=partitioned-schema.sql SCRIPTS="..." bench/pgbench/run.sh  # see that file
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS=${ROUNDS:-3}
SECONDS_EACH=${SECONDS_EACH:-8}
CLIENTS=${CLIENTS:-8}
CONN=(-h "${PGHOST:-127.0.0.1}" -p "${PGPORT:-5432}" -U "${PGUSER:-postgres}")
DB=idem_pgbench_$$
psql "${CONN[@]}" -qc "CREATE DATABASE $DB"
trap 'psql "${CONN[@]}" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)"' EXIT
psql "${CONN[@]}" -d "$DB" -q -v ON_ERROR_STOP=1 -f "${SCHEMA:-schema.sql}"
scripts=(new-bare new-inline new-idem new-idem-lookupfirst new-insert-at-end new-idempgx dup-inline dup-idem dup-select)
# SCRIPTS="new-bare new-idempgx" runs only those.
if [ -n "${SCRIPTS:-}" ]; then read -r -a scripts <<<"$SCRIPTS"; fi
for r in $(seq 1 "$ROUNDS"); do
  for s in "${scripts[@]}"; do
    tps=$(pgbench "${CONN[@]}" -n -M prepared -c "$CLIENTS" -j 2 -T "$SECONDS_EACH" -f "$s.sql" "$DB" 2>&1 |
      sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    printf 'round %d  %-22s %10.0f tps\n' "$r" "$s" "${tps:-0}"
  done
done
