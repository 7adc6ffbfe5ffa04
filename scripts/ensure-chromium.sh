#!/usr/bin/env bash
# Makes sure Debian's Chromium (and ChromeDriver) is installed for the
# operator UI's browser tests (internal/browsertest): installs the packages
# chromium and chromium-driver with apt-get when chromium is missing. Safe to
# run again.
set -euo pipefail
command -v chromium >/dev/null && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ensure-chromium: chromium is missing and cannot be installed here (root and apt-get needed); Debian: apt-get install chromium chromium-driver" >&2
  exit 1
fi
echo "ensure-chromium: installing chromium and chromium-driver with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
