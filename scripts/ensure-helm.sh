#!/usr/bin/env bash
# Prints the path of a helm binary, installing helm (pinned) with `go install`
# when there is none: about 2 minutes the first time, then cached in
# $(go env GOPATH)/bin. The chart checks in .ci/run and the chart test
# (cargo test --test e2e chart::) use it.
set -euo pipefail
HELM_VERSION=v3.22.0

if command -v helm >/dev/null 2>&1; then
  command -v helm
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "ensure-helm: neither helm nor go is installed; install Go (https://go.dev/dl) or helm" >&2
  exit 1
fi
gobin="$(go env GOPATH)/bin"
if [ ! -x "$gobin/helm" ]; then
  echo "ensure-helm: installing helm $HELM_VERSION with go install (about 2 minutes)" >&2
  go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
fi
echo "$gobin/helm"
