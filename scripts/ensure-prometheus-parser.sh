#!/usr/bin/env bash
# Prints the path of a small program that parses the OpenMetrics text format
# (what binxd's /metrics serves) from stdin with the prometheus_client Python
# package's own OpenMetrics parser (pinned, installed with pip under
# target/tools/prometheus-client when missing; a few seconds the first time)
# and prints one line per metric family: "name type unit samples" (unit "-"
# when none). It exits 1, with the parser's error, on text the
# parser refuses. The metrics test (cargo test --test e2e metrics::) uses it.
set -euo pipefail
PROMETHEUS_CLIENT_VERSION=0.26.0
cd "$(dirname "$0")/.."
prefix="$PWD/target/tools/prometheus-client"
program="$prefix/parse-openmetrics"
if [ ! -x "$program" ] || [ ! -d "$prefix/lib/prometheus_client" ]; then
  if ! command -v python3 >/dev/null 2>&1; then
    echo "ensure-prometheus-parser: python3 is not installed" >&2
    exit 1
  fi
  echo "ensure-prometheus-parser: installing prometheus_client $PROMETHEUS_CLIENT_VERSION with pip" >&2
  mkdir -p "$prefix"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$prefix/lib" "prometheus_client==$PROMETHEUS_CLIENT_VERSION" >&2
  cat >"$program.tmp" <<PY
#!/usr/bin/env python3
import sys
sys.path.insert(0, "$prefix/lib")
from prometheus_client.openmetrics.parser import text_string_to_metric_families
try:
    for family in text_string_to_metric_families(sys.stdin.read()):
        print(family.name, family.type, family.unit or "-", len(family.samples))
except Exception as e:
    print("prometheus_client refused the text:", e, file=sys.stderr)
    sys.exit(1)
PY
  chmod +x "$program.tmp"
  mv "$program.tmp" "$program"
fi
echo "$program"
