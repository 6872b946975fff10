#!/usr/bin/env bash
# Offline checks of everything under configs/: YAML syntax, custom resources against our CRDs,
# the Helm chart, and (when kubectl is installed) kubectl's own reading of every manifest.
# No cluster is needed or contacted. Exits non-zero on the first real problem.
#
#   scripts/check-manifests.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=scripts/check_manifests.py
CHART=configs/helm/propeller
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

section() { printf '\n== %s\n' "$*"; }

section "python3 and PyYAML"
if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is required" >&2
  exit 1
fi
if ! python3 -c 'import yaml' >/dev/null 2>&1; then
  echo "  PyYAML missing; installing it with pip"
  python3 -m pip install --quiet pyyaml || { echo "error: cannot install PyYAML" >&2; exit 1; }
fi
python3 -c 'import sys, yaml; print(f"  python {sys.version.split()[0]}, PyYAML {yaml.__version__}")'

section "YAML syntax (every *.yaml under configs/)"
python3 "$PY" yaml configs

section "custom resources against configs/crd/ (structural schemas)"
python3 "$PY" crs configs configs/crd

section "Helm chart $CHART"
python3 "$PY" chart "$CHART" "$WORK/chart"
if command -v helm >/dev/null 2>&1; then
  helm lint "$CHART"
  helm template propeller "$CHART" --namespace propeller-system >"$WORK/chart/helm-template.yaml"
  echo "  helm: lint passed; helm template rendered $(grep -c '^kind:' "$WORK/chart/helm-template.yaml") objects"
else
  echo "  helm: not installed; the chart was rendered by the Python Go-template interpreter above"
fi

section "kubectl"
if ! command -v kubectl >/dev/null 2>&1; then
  echo "  kubectl: not installed; skipped"
  echo
  echo "check-manifests: OK (without kubectl)"
  exit 0
fi
echo "  $(kubectl version --client 2>/dev/null | head -n1)"
# `kubectl apply --dry-run=client` needs a server (it reads the live object), so kubectl's
# reading is checked with `create --dry-run=client --validate=false` against a discovery cache
# written from the built-in kinds and configs/crd: it decodes every object and maps its
# apiVersion/kind to a known resource, all without a network connection.
python3 "$PY" discovery configs/crd "$WORK/kube"
export KUBECONFIG="$WORK/kube/kubeconfig"
kc() { kubectl --cache-dir "$WORK/kube/cache" --request-timeout=5s "$@" </dev/null; }

dry_run() { # dry_run LABEL FILE|DIR
  local out
  if ! out="$(kc create --dry-run=client --validate=false -o name -f "$2" 2>"$WORK/kubectl.err")"; then
    cat "$WORK/kubectl.err" >&2
    echo "error: kubectl rejected $1 (a 'connection refused' here means an apiVersion/kind" \
      "that is neither built in nor in configs/crd, so kubectl went looking for a server)" >&2
    exit 1
  fi
  echo "  kubectl create --dry-run=client: $1: $(grep -c . <<<"$out") objects"
}

for dir in configs/crd configs/rbac configs/deploy configs/samples; do
  if ! kc kustomize "$dir" >"$WORK/kustomize.yaml" 2>"$WORK/kustomize.err"; then
    cat "$WORK/kustomize.err" >&2
    echo "error: kubectl kustomize $dir failed" >&2
    exit 1
  fi
  echo "  kubectl kustomize $dir: $(grep -c '^kind:' "$WORK/kustomize.yaml") objects"
  dry_run "kustomize $dir" "$WORK/kustomize.yaml"
done
dry_run "configs/samples/quickstart/" configs/samples/quickstart
dry_run "$CHART/crds/" "$CHART/crds"
for rendered in "$WORK"/chart/*.yaml; do
  dry_run "chart render $(basename "$rendered" .yaml)" "$rendered"
done

echo
echo "check-manifests: OK"
