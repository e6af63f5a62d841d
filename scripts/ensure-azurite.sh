#!/usr/bin/env bash
# Prints the path of azurite-blob (Microsoft's Azure Storage emulator),
# installing it (pinned) with npm under target/tools/azurite when missing:
# about 20 seconds the first time. The Azure spooling test
# (cargo test --test e2e spool::azure) uses it.
set -euo pipefail
AZURITE_VERSION=3.35.0
cd "$(dirname "$0")/.."
prefix="$PWD/target/tools/azurite"
bin="$prefix/node_modules/.bin/azurite-blob"
if [ ! -x "$bin" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "ensure-azurite: npm is not installed; install Node.js (https://nodejs.org)" >&2
    exit 1
  fi
  echo "ensure-azurite: installing azurite $AZURITE_VERSION with npm" >&2
  mkdir -p "$prefix"
  npm install --prefix "$prefix" --no-audit --no-fund --silent "azurite@$AZURITE_VERSION" >&2
fi
echo "$bin"
