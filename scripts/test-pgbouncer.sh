#!/usr/bin/env bash
# The root module's tests a second time, through PgBouncer in transaction
# pooling mode, as many deployments run it. Installs Debian's pgbouncer if
# it is missing, starts it on a free loopback port in front of the
# PostgreSQL at 127.0.0.1:5432 (trust auth, as scripts/ensure-postgres.sh
# sets up), runs `go test -race` with DATABASE_URL pointing at it, and stops
# it on exit. Each server connection serves one transaction at a time and
# then goes back to the pool, so anything that outlives a transaction on a
# connection (session SET, session advisory locks, named prepared
# statements) would break here: idem uses none. pgx needs
# default_query_exec_mode=exec (see docs/pgbouncer.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh

if ! command -v pgbouncer >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test-pgbouncer: installing pgbouncer with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq pgbouncer >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "test-pgbouncer: pgbouncer is missing and cannot be installed here (root and apt-get needed)" >&2
    exit 1
  else
    echo "== PgBouncer pass skipped: pgbouncer is not installed (CI installs it; Debian: apt-get install pgbouncer)"
    exit 0
  fi
fi

# PgBouncer refuses to run as root: run it as the postgres user, in a
# directory that user owns.
dir=$(mktemp -d /tmp/idem-pgbouncer.XXXXXX)
as_user=()
if [ "$(id -u)" = 0 ]; then
  chown postgres "$dir"
  as_user=(runuser -u postgres --)
fi

pid=
stop() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -INT "$pid" 2>/dev/null || true # SIGINT: shut down at once
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$dir" "$steps_dir"
}
trap stop EXIT

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  local port=$1
  cat >"$dir/userlist.txt" <<USERS
"postgres" ""
USERS
  cat >"$dir/pgbouncer.ini" <<INI
[databases]
; every database name passes through, the test harness's CREATE DATABASE
; target included
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
; roles other than postgres (a test makes one) are looked up with auth_query
auth_user = postgres
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
  chmod a+r "$dir"/*
  "${as_user[@]}" pgbouncer -d "$dir/pgbouncer.ini"
  for _ in $(seq 1 50); do
    if [ -s "$dir/pgbouncer.pid" ] && ! port_free "$port"; then
      pid=$(cat "$dir/pgbouncer.pid")
      return 0
    fi
    sleep 0.1
  done
  return 1
}

port=
for candidate in $(shuf -i 20000-29999 -n 20); do
  port_free "$candidate" || continue
  if start "$candidate"; then
    port=$candidate
    break
  fi
  cat "$dir/pgbouncer.log" >&2 || true
done
if [ -z "$port" ]; then
  echo "test-pgbouncer: PgBouncer did not start" >&2
  exit 1
fi
echo "== root module through PgBouncer $(pgbouncer --version | head -n 1 | awk '{print $2}') (transaction pooling, pgx ${PGX_EXEC_MODE:-exec}) on 127.0.0.1:$port: go test -race"

# exec: the extended protocol with unnamed statements, parsed and run in one
# round trip, never a named prepared statement. PGX_EXEC_MODE=simple_protocol
# runs the suite with the other mode that works here.
export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable&default_query_exec_mode=${PGX_EXEC_MODE:-exec}"
once='^(TestDocCodeCompiles|TestGuaranteesNameRealTests)$' # nothing there goes through a database
# internal/failover is left out: its tests start PostgreSQL clusters of their
# own and never use DATABASE_URL, so they would only run a second time.
sql_pass() { go test -race -count=1 -timeout 5m -skip "$once" $(go list ./... | grep -v '/internal/failover$'); }
# The behaviour suite again on the pgx adapter (idempgx), same DSN: its
# batches run in the same exec mode.
pgx_pass() { IDEM_ADAPTER=pgx go test -race -count=1 -timeout 5m -skip "$once" .; }
# And the partitioned tables' own tests (docs/partitioning.md): the sweep
# detaches partitions CONCURRENTLY, one statement, which transaction pooling
# allows; the summaries list partitions and transactions in the background.
partitioned_pass() {
  IDEM_LAYOUT=partitioned go test -race -count=1 -timeout 5m -skip "$once" \
    -run 'Partition|Summar|Sweep|Migrate|Storm|Check|Stats' .
}
if ! together "through PgBouncer, database/sql adapter" sql_pass \
  -- "through PgBouncer, pgx adapter (IDEM_ADAPTER=pgx)" pgx_pass \
  -- "through PgBouncer, partitioned tables (IDEM_LAYOUT=partitioned)" partitioned_pass; then
  echo "test-pgbouncer: tests failed through PgBouncer; its log:" >&2
  tail -n 50 "$dir/pgbouncer.log" >&2 || true
  exit 1
fi
