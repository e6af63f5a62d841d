#!/usr/bin/env bash
# Builds the binx Trino exchange plugin and prints its plugin directory (the
# last line): copy that directory into Trino's plugin/ directory (as
# plugin/binx) on every node, coordinator included, and set
# etc/exchange-manager.properties (docs/ENGINES.md, "Trino fault-tolerant execution").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/java.sh package >&2
dir="$PWD/target/java/trino-exchange-binx/plugin/binx"
[ -f "$dir/trino-exchange-binx-0.1.0.jar" ] || { echo "trino-plugin.sh: no plugin jar in $dir" >&2; exit 1; }
echo "$dir"
