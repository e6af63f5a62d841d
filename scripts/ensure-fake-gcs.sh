#!/usr/bin/env bash
# Prints the path of fake-gcs-server (a Google Cloud Storage emulator),
# building it when missing under target/tools/fake-gcs-server: about a
# minute on 2 cores the first time. The GCS spooling test
# (cargo test --test e2e spool::google) uses it.
#
# The release is pinned and fetched from the Go module proxy, then one
# small patch (scripts/fake-gcs-server-xml-put.patch) is applied before the
# build: object_store's GCS client uploads with the XML API
# (PUT /{bucket}/{object}), which fake-gcs-server only accepts for signed
# URLs (upstream: fsouza/fake-gcs-server#331, #1164; object_store's own CI
# runs a patched fork for the same reason). Everything else is upstream.
set -euo pipefail
FAKE_GCS_VERSION=v1.56.1
cd "$(dirname "$0")/.."
repo="$PWD"
patch="$repo/scripts/fake-gcs-server-xml-put.patch"
stamp="$(sha256sum "$patch" | cut -c1-12)"
tooldir="$repo/target/tools/fake-gcs-server/$FAKE_GCS_VERSION-$stamp"
bin="$tooldir/fake-gcs-server"
if [ ! -x "$bin" ]; then
  if ! command -v go >/dev/null 2>&1; then
    echo "ensure-fake-gcs: go is not installed; install Go (https://go.dev/dl)" >&2
    exit 1
  fi
  echo "ensure-fake-gcs: building fake-gcs-server $FAKE_GCS_VERSION (patched: XML API uploads)" >&2
  module="$(go mod download -json "github.com/fsouza/fake-gcs-server@$FAKE_GCS_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  src="$tooldir.src"
  rm -rf "$src"
  mkdir -p "$(dirname "$src")"
  cp -r "$module" "$src"
  chmod -R u+w "$src"
  # GIT_CEILING_DIRECTORIES keeps git apply from treating target/ as part
  # of this repository: the patch applies to the copied module alone.
  (cd "$src" && GIT_CEILING_DIRECTORIES="$(dirname "$src")" git apply "$patch")
  (cd "$src" && GOFLAGS=-mod=mod go build -o "$bin.tmp" .)
  mv "$bin.tmp" "$bin"
  rm -rf "$src"
fi
echo "$bin"
