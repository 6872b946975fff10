#!/usr/bin/env bash
# Kubernetes mode: `propeller run` (release) against a real kube-apiserver on this machine
# (`propeller-envtest`: etcd and kube-apiserver v1.36, data on /dev/shm), authenticated as
# its ServiceAccount, with real agents and simulated proplets.
#
#   scripts/bench-k8s.sh [pipeline|heartbeats N|all]      (default: all, N = 5000 and 10000)
#
# pipeline:   first a baseline: 1,000 Task POSTs to the API server alone, before propeller
#             starts (the ceiling for any burst here), and the API server's CPU per write of
#             a few kinds (ConfigMap and Proplet creates and patches). Then 4 `proplet` agents. One
#             add(10, 32) at a time, 30 runs after 5 warm-ups: POST Task -> a watch event
#             showing it completed (median, p99). Then 1,000 Tasks
#             POSTed at once from 8 connections: tasks/s from the first POST to the last
#             completion seen on the watch.
# heartbeats: N Proplets with their Secrets, N simulated proplets (`propeller-loadgen
#             heartbeats`, real MQTT connections) heartbeating every 10 s; after a steady
#             minute 1,000 go silent. Reports propeller's and the API server's CPU apart,
#             Proplet status writes (the API server's own request counter) per proplet per
#             flush interval, the time from the silence until all 1,000 are Offline (a
#             watch on them; threshold 30 s), and where the machine's CPU went meanwhile.
# Needs etcd (`apt-get install etcd-server`) and the envtest binaries (KUBEBUILDER_ASSETS or
# ../shared/envtest), as the tests do.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
scripts/build-release.sh
BIN=target/release
# PROPELLER_BIN: another propeller binary to measure (an earlier build, for before/after).
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
source scripts/lib/harness.sh
scratch_workspace

# One control plane and one operator per measurement, so runs do not share state.
run_one() {
  local what=$1 n=${2:-0}
  local dir="$WORK/$what-$n"
  start_control_plane "$dir" "$BIN"
  local envtest=$ENVTEST_PID apiserver=$APISERVER_PID
  PIDS+=("$envtest")
  local mqtt metrics
  mqtt=$(free_port); metrics=$(free_port)
  if [ "$what" = pipeline ]; then
    "$PYTHON" scripts/bench_k8s_run.py baseline 0 "$dir/admin.kubeconfig" 0 "$BIN" 0 "$apiserver" "$dir"
  fi
  KUBECONFIG="$dir/propeller.kubeconfig" RUST_LOG=warn,rumqttd=off "$PROPELLER" run \
    --leader-elect --lease-namespace propeller-system --mqtt-listen "127.0.0.1:$mqtt" \
    --metrics-listen "127.0.0.1:$metrics" --liveliness-interval 10s --last-seen-threshold 30s \
    --status-flush-interval 5s >"$dir/propeller.log" 2>&1 &
  local propeller=$!
  PIDS+=("$propeller")
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$metrics/readyz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  PROPELLER_METRICS="127.0.0.1:$metrics" "$PYTHON" scripts/bench_k8s_run.py "$what" "$n" \
    "$dir/admin.kubeconfig" "$mqtt" "$BIN" "$propeller" "$apiserver" "$dir"
  kill "$propeller" "$envtest" 2>/dev/null || true
  wait "$propeller" "$envtest" 2>/dev/null || true
  cp "$dir/propeller.log" "${TMPDIR:-/tmp}/bench-k8s-$what-$n-propeller.log" 2>/dev/null || true
}

case "$MODE" in
  pipeline) run_one pipeline ;;
  heartbeats) run_one heartbeats "${2:-10000}" ;;
  all)
    run_one pipeline
    run_one heartbeats 5000
    run_one heartbeats 10000
    ;;
  *) echo "usage: $0 [pipeline|heartbeats N|all]" >&2; exit 2 ;;
esac
