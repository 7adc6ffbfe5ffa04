#!/usr/bin/env bash
# Makes sure a PostgreSQL server answers on 127.0.0.1:5432 for the tests:
# starts the installed cluster if it is down, installs Debian's postgresql
# (and lets local TCP connections in without a password, as on the
# development machines) if it is missing. Safe to run again.
set -euo pipefail

ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if command -v pg_isready >/dev/null && ready; then
  exit 0
fi

if ! command -v pg_lsclusters >/dev/null || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
  echo "ensure-postgres: PostgreSQL is not installed; installing it with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba=/etc/postgresql/$ver/main/pg_hba.conf
  # Trust on loopback only: the tests connect as postgres@127.0.0.1.
  sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
  sed -i -E 's/^(local\s+all\s+postgres\s+)\S+/\1trust/' "$hba"
fi

ver=$(ls /etc/postgresql | sort -V | tail -n 1)
echo "ensure-postgres: starting PostgreSQL $ver" >&2
pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
for _ in $(seq 1 60); do
  ready && exit 0
  sleep 0.5
done
echo "ensure-postgres: PostgreSQL did not come up on 127.0.0.1:5432" >&2
exit 1
