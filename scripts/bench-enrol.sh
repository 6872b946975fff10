#!/usr/bin/env bash
# N devices enrolling at once with one bootstrap token (`propeller-loadgen enrol`: the agent's
# own `proplet join` code over TLS, then heartbeats with the new credentials), against
# `propeller standalone` and against `propeller run` on a real kube-apiserver. Prints, per
# mode, the time from the first request to the last Proplet Running, propeller's CPU and, in
# Kubernetes mode, the API server's CPU and its requests per enrolled device.
#
#   scripts/bench-enrol.sh [N] [standalone|kubernetes|all]      (default: 1000 all)
#
# BENCH_BIN_DIR: the binaries to measure (default: a release build, scripts/build-release.sh).
# Needs etcd and the envtest binaries for the Kubernetes mode, as the tests do.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
MODE=${2:-all}
if [ -z "${BENCH_BIN_DIR:-}" ]; then
  scripts/build-release.sh
  BIN=target/release
else
  BIN=$BENCH_BIN_DIR
fi
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
source scripts/lib/harness.sh
scratch_workspace
export PYTHONPATH=scripts

standalone() {
  local dir="$WORK/standalone" tls
  tls=$(free_port)
  RUST_LOG=warn start_standalone "$BIN/propeller" "$dir" "$WORK/standalone.log" \
    --mqtt-tls-listen "127.0.0.1:$tls"
  PIDS+=("$STANDALONE_PID")
  local token
  token=$("$BIN/propeller" token create --uses "$N" --server "127.0.0.1:$API" --data-dir "$dir" 2>/dev/null)
  sleep 1
  "$PYTHON" scripts/bench_enrol.py standalone "$N" "$BIN" "$STANDALONE_PID" "$API" "$dir" \
    "$tls" "$dir/tls/ca.pem" "$token"
  kill "$STANDALONE_PID"; wait "$STANDALONE_PID" 2>/dev/null || true
}

kubernetes() {
  local dir="$WORK/kube" tls metrics mqtt
  start_control_plane "$dir" "$BIN"
  PIDS+=("$ENVTEST_PID")
  tls=$(free_port); metrics=$(free_port); mqtt=$(free_port)
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=propeller bench CA" -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$dir/server-key.pem" -out "$dir/server.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > "$dir/san.ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
    -CAcreateserial -days 1 -extfile "$dir/san.ext" -out "$dir/server.pem" 2>/dev/null
  KUBECONFIG="$dir/propeller.kubeconfig" RUST_LOG=warn,rumqttd=off "$BIN/propeller" run \
    --leader-elect --lease-namespace propeller-system --token-namespace propeller-system \
    --mqtt-listen "127.0.0.1:$mqtt" --tls-listen "127.0.0.1:$tls" --tls-cert "$dir/server.pem" \
    --tls-key "$dir/server-key.pem" --metrics-listen "127.0.0.1:$metrics" \
    --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s \
    >"$dir/propeller.log" 2>&1 &
  local propeller=$!
  PIDS+=("$propeller")
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$metrics/readyz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  local token
  token=$(KUBECONFIG="$dir/admin.kubeconfig" "$BIN/propeller" token create --kubernetes \
    --token-namespace propeller-system --uses "$N" 2>/dev/null)
  sleep 1
  "$PYTHON" scripts/bench_enrol.py kubernetes "$N" "$BIN" "$propeller" "$dir/admin.kubeconfig" \
    "$APISERVER_PID" "$tls" "$dir/ca.pem" "$token"
  kill "$propeller" "$ENVTEST_PID" 2>/dev/null || true
  wait "$propeller" "$ENVTEST_PID" 2>/dev/null || true
}

case "$MODE" in
  standalone) standalone ;;
  kubernetes) kubernetes ;;
  all) standalone; kubernetes ;;
  *) echo "usage: $0 [N] [standalone|kubernetes|all]" >&2; exit 2 ;;
esac
