#!/usr/bin/env bash
# Active-active replicas (`propeller run --shard`, release) against a real kube-apiserver on
# this machine and a 3-node NATS cluster: 1 replica, then 3, each time on a fresh control
# plane and cluster (scripts/bench_shard.py says what is measured).
#
#   scripts/bench-shard.sh [N] [REPLICAS...]     (default: N = 30000, replicas 1 and 3)
#
# BENCH_NAMESPACES=K spreads the proplets and tasks over K namespaces (one real agent in
# each); BENCH_SHARDED_WATCHES=1 runs the replicas with --sharded-watches, on an API server
# with its ShardedListAndWatch feature gate on.
# Needs etcd, nats-server and the envtest binaries, as the tests do (scripts/test.sh
# installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-30000}
shift || true
COUNTS=("$@")
[ ${#COUNTS[@]} -gt 0 ] || COUNTS=(1 3)
scripts/build-release.sh
BIN=target/release
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
source scripts/lib/harness.sh
scratch_workspace
if [ "${BENCH_SHARDED_WATCHES:-}" = 1 ]; then
  export ENVTEST_ARGS="--sharded-list-and-watch"
fi

for replicas in "${COUNTS[@]}"; do
  dir="$WORK/r$replicas"
  start_control_plane "$dir" "$BIN"
  PIDS+=("$ENVTEST_PID")
  "$PYTHON" scripts/bench_shard.py "$BIN" "$N" "$replicas" "$dir" "$APISERVER_PID"
  kill "$ENVTEST_PID" 2>/dev/null || true
  wait "$ENVTEST_PID" 2>/dev/null || true
done
