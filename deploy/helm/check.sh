#!/usr/bin/env bash
# Chart checks (run by .ci/run): helm lint, helm template of the defaults,
# of every examples/*.yaml and of the plain-container variant, each
# validated by kubernetes-validate --strict against the Kubernetes schemas
# of the oldest and a current supported version; values the schema must
# refuse are refused. The pod's content is tested by `cargo test --test e2e
# chart::`, which also starts binxd with the rendered configuration.
set -euo pipefail
cd "$(dirname "$0")/../.."
chart=deploy/helm/binx
helm="$(scripts/ensure-helm.sh)"
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  echo "== installing kubernetes-validate"
  python3 -m pip install --quiet "kubernetes-validate==1.37.0"
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "== helm lint"
"$helm" lint --strict --kube-version 1.31.0 "$chart"

render() { # name, then helm template arguments
  local name="$1"; shift
  "$helm" template binx "$chart" --namespace exchange --kube-version 1.31.0 "$@" >"$out/$name.yaml"
  for k8s in 1.29.0 1.34.0; do
    kubernetes-validate --strict --quiet -k "$k8s" "$out/$name.yaml"
  done
  echo "ok: $name ($(grep -c '^kind:' "$out/$name.yaml") resources)"
}

echo "== helm template + kubernetes-validate --strict"
render defaults
for values in "$chart"/examples/*.yaml; do
  render "example-$(basename "$values" .yaml)" -f "$values"
done
render grafana-dashboard --set serviceMonitor.enabled=true --set grafanaDashboard.enabled=true
# The ConfigMap carries the dashboard file byte for byte.
python3 - "$out/grafana-dashboard.yaml" "$chart/dashboards/binx-dashboard.json" <<'PY'
import json, sys
rendered, dashboard = sys.argv[1], sys.argv[2]
text = open(rendered).read()
want = open(dashboard).read()
start = text.index("binx-dashboard.json: |-\n") + len("binx-dashboard.json: |-\n")
body = []
for line in text[start:].split("\n"):
    if line and not line.startswith("    "):
        break
    body.append(line[4:])
got = "\n".join(body).rstrip("\n")
assert got == want.rstrip("\n"), "the rendered dashboard differs from dashboards/binx-dashboard.json"
json.loads(got)
print("ok: the dashboard ConfigMap holds dashboards/binx-dashboard.json")
PY
render plain-container --set binxd.nativeSidecar=false --set workload.kind=Deployment \
  --set binxd.tls.existingSecret=binx-tls --set binxd.tls.clientAuth=true \
  --set sharedMemory.enabled=true --set binxd.sharedSecret.existingSecret=cluster-secret \
  --set-json 'networkPolicy.engineFrom=[{"podSelector":{"matchLabels":{"app":"trino"}},"namespaceSelector":{"matchLabels":{"team":"query"}}}]' \
  --set binxd.ports.binx=1 --set binxd.ports.http=65535

echo "== values the schema refuses"
refuse() { # reason, then --set arguments
  local reason="$1"; shift
  if "$helm" template binx "$chart" --kube-version 1.31.0 "$@" >/dev/null 2>"$out/err"; then
    echo "FAIL: accepted $*: $reason" >&2
    exit 1
  fi
  echo "refused ($reason): $(grep -m1 -o 'at .*' "$out/err" || head -c 200 "$out/err")"
}
refuse "unknown workload kind" --set workload.kind=Job
refuse "unknown spool policy" --set binxd.spool.defaultPolicy=sometimes
refuse "misspelt key" --set binxd.memoryLimt=2GiB
refuse "port out of range" --set binxd.ports.binx=70000
refuse "engine named like the sidecar" --set engine.name=binxd
refuse "not a variable name" --set engine.sharedSecretEnv=1-SECRET
echo "chart checks passed"
