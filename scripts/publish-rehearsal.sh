#!/usr/bin/env bash
# The publish rehearsal (RELEASING.md): every public module, as the commit
# REV (default HEAD) would be tagged at IDEM_RELEASE_VERSION (default
# v0.1.0), installed the way a new user installs it.
#
# It writes a file-system module proxy holding the modules, zipped from the
# committed files only, then works in scratch modules outside the
# repository, with an empty module cache and the go command's defaults
# (GOFLAGS empty, so no -mod=mod: a missing go.sum entry fails as it does
# for a user):
#   - for each module, go get it at that version (with the root module, as
#     the README's install lines do), then build, vet and run a small
#     program that imports it (internal/tools/modcheck/testdata/rehearsal),
#     go mod tidy, build again;
#   - for each adapter module, go get it alone and go mod tidy: the root
#     version it requires must exist and be the one rehearsed;
#   - go install of the idem command at that version, run.
# Builds use -trimpath only so that compiled packages are reused from one
# run to the next (the module cache's path changes every run); it changes
# nothing in how modules are resolved.
#
# github.com/pgidem modules come from the rehearsal's proxy only: the
# go.sum lines the scratch modules end with must be that proxy's hashes.
# Third-party modules come from this machine's module cache (read-only, as a
# file proxy), else from the usual proxy, and are verified against the
# checksum database as usual; GONOSUMDB=github.com/pgidem keeps the
# unpublished versions from being looked up there.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
version=${IDEM_RELEASE_VERSION:-v0.1.0}
rev=${REV:-HEAD}
start=$SECONDS

work=$(mktemp -d "${TMPDIR:-/tmp}/idem-rehearsal.XXXXXX")
machine_cache=$(go env GOMODCACHE)
usual_proxy=$(go env GOPROXY)
cleanup() {
  # The module cache is read-only: go clean empties it.
  GOMODCACHE="$work/modcache" GOFLAGS= go clean -modcache 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

go build -C internal/tools/modcheck -o "$work/modcheck" .
"$work/modcheck" proxy -rev "$rev" -version "$version" -out "$work/proxy"
"$work/modcheck" sums -proxy "$work/proxy" | sort >"$work/proxy.sums"

# From here on, the go command as a new user runs it.
export GOMODCACHE="$work/modcache" GOBIN="$work/bin" GOPATH="$work/gopath"
export GOPROXY="file://$work/proxy,file://$machine_cache/cache/download,$usual_proxy"
export GONOSUMDB=github.com/pgidem GOFLAGS= GOWORK=off GOTOOLCHAIN=local
unset GONOSUMCHECK GONOPROXY GOPRIVATE GOINSECURE

# The idem package imports only the standard library: a program that
# imports only it builds without the code of its module's other
# requirements (the tests' and idempgx's). (go mod tidy then downloads them,
# to record the checksums of what the tests of the packages it imports
# need.)
nothing_else_downloaded() {
  local m
  for m in github.com/stretchr/testify github.com/!d!a!t!a-!d!o!g/go-sqlmock go.uber.org/goleak github.com/jackc/pgx/v5; do
    if ls "$GOMODCACHE/cache/download/$m/@v/"*.zip >/dev/null 2>&1; then
      echo "rehearsal idem: building a program that imports only idem downloaded $m"
      exit 1
    fi
  done
}

# from_the_proxy_only NAME: every github.com/pgidem line of the go.sum in
# the working directory is a hash of the rehearsal's proxy, so no other
# source served a pgidem module.
from_the_proxy_only() {
  local stray
  stray=$(grep '^github.com/pgidem/' go.sum | sort | comm -23 - "$work/proxy.sums")
  if [ -n "$stray" ]; then
    echo "rehearsal $1: go.sum has github.com/pgidem modules the rehearsal's proxy did not serve:"
    echo "$stray"
    exit 1
  fi
}

# rehearse NAME PACKAGE...: a scratch module that go gets the packages at
# the version, as the README's install lines do, and builds, vets and runs
# testdata/rehearsal/NAME with it. (Not in a subshell: set -e must hold.)
rehearse() {
  local name=$1; shift
  local dir="$work/try-$name" pkg args=()
  echo "-- $name: go get $*"
  mkdir -p "$dir"
  cp "$repo/internal/tools/modcheck/testdata/rehearsal/$name/main.go" "$repo/internal/tools/modcheck/testdata/rehearsal/shared.go" "$dir/"
  cd "$dir"
  go mod init "example.com/rehearsal/$name" 2>/dev/null
  for pkg in "$@"; do args+=("$pkg@$version"); done
  go get "${args[@]}" 2>&1 | { grep -v '^go: \(downloading\|added\|upgraded\|finding\|found\)' || true; }
  go build -trimpath -o "$dir/program" .
  go vet -trimpath ./...
  "$dir/program"
  [ "$name" != idem ] || nothing_else_downloaded
  go mod tidy
  go build -trimpath -o /dev/null .
  from_the_proxy_only "$name"
  cd "$repo"
}

# rehearse_alone NAME MODULE: a scratch module that go gets only the
# adapter MODULE, with the README's line (@latest: the rehearsal's proxy
# lists the version alone), and lets go mod tidy find the rest: the root
# module it imports must come at the version MODULE requires, and that
# version must exist.
rehearse_alone() {
  local name=$1 module=$2
  local dir="$work/alone-$name" got m
  echo "-- $name alone: go get $module@latest, go mod tidy"
  mkdir -p "$dir"
  cp "$repo/internal/tools/modcheck/testdata/rehearsal/$name/main.go" "$repo/internal/tools/modcheck/testdata/rehearsal/shared.go" "$dir/"
  cd "$dir"
  go mod init "example.com/rehearsal/$name-alone" 2>/dev/null
  go get "$module@latest" 2>&1 | { grep -v '^go: \(downloading\|added\|upgraded\|finding\|found\)' || true; }
  go mod tidy
  go build -trimpath -o /dev/null .
  for m in "$module" github.com/pgidem/idem; do
    got=$(go list -m -f '{{.Version}}' "$m")
    if [ "$got" != "$version" ]; then
      echo "rehearsal $name alone: got $m $got, want $version"
      exit 1
    fi
  done
  from_the_proxy_only "$name alone"
  cd "$repo"
}

rehearse idem github.com/pgidem/idem
rehearse idempgx github.com/pgidem/idem github.com/pgidem/idem/idempgx
rehearse idemgin github.com/pgidem/idem github.com/pgidem/idem/idemgin
rehearse idemprom github.com/pgidem/idem github.com/pgidem/idem/idemprom
rehearse idemui github.com/pgidem/idem github.com/pgidem/idem/idemui
rehearse idemgrpc github.com/pgidem/idem github.com/pgidem/idem/idemgrpc
rehearse idemnats github.com/pgidem/idem github.com/pgidem/idem/idemnats
rehearse idemwatermill github.com/pgidem/idem github.com/pgidem/idem/idemwatermill
rehearse idemrabbitmq github.com/pgidem/idem github.com/pgidem/idem/idemrabbitmq
rehearse idemotel github.com/pgidem/idem github.com/pgidem/idem/idemotel
rehearse_alone idemgin github.com/pgidem/idem/idemgin
rehearse_alone idemprom github.com/pgidem/idem/idemprom
rehearse_alone idemui github.com/pgidem/idem/idemui
rehearse_alone idemgrpc github.com/pgidem/idem/idemgrpc
rehearse_alone idemnats github.com/pgidem/idem/idemnats
rehearse_alone idemwatermill github.com/pgidem/idem/idemwatermill
rehearse_alone idemrabbitmq github.com/pgidem/idem/idemrabbitmq
rehearse_alone idemotel github.com/pgidem/idem/idemotel
echo "-- go install github.com/pgidem/idem/cmd/idem@$version"
go install -trimpath "github.com/pgidem/idem/cmd/idem@$version" 2>&1 | { grep -v '^go: downloading' || true; }
usage=$("$GOBIN/idem" -h)
grep -q '^Usage: idem <command>' <<<"$usage" || { echo "rehearsal: idem -h did not print its usage:"; echo "$usage"; exit 1; }

echo "rehearsal: every public module installs at $version from $rev ($(git -C "$repo" rev-parse --short "$rev")) in $((SECONDS - start)) s"
