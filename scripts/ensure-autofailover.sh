#!/usr/bin/env bash
# Makes sure pg_auto_failover is installed for the HA manager's failover
# test (internal/hatest): Debian's postgresql-15-auto-failover (the
# extension, for the monitor) and pg-auto-failover-cli (pg_autoctl).
# Installs them with apt-get when missing. Safe to run again.
set -euo pipefail

have() {
  command -v pg_autoctl >/dev/null &&
    [ -f /usr/share/postgresql/15/extension/pgautofailover.control ]
}

if have; then
  exit 0
fi
echo "ensure-autofailover: pg_auto_failover is not installed; installing it with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq postgresql-15-auto-failover pg-auto-failover-cli >/dev/null
have || { echo "ensure-autofailover: pg_autoctl or the pgautofailover extension is still missing" >&2; exit 1; }
