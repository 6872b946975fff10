#!/usr/bin/env bash
# Leader failover under load (issue 19), Kubernetes mode on a real kube-apiserver
# (`propeller-envtest`): two `propeller run --leader-elect` replicas authenticated as the
# ServiceAccount, 4 real agents reaching the broker through a forwarder that plays the
# Service (it connects to whichever replica accepts MQTT: only the leader listens), and
# 1,000 add tasks POSTed at once. The leader is killed (-9) while tasks are in flight; the
# standby takes the Lease, the agents reconnect through the forwarder, and every task must
# end completed exactly once with add(a, b) = a + b:
#   lost    = not completed with the right sum 180 s after the kill,
#   doubled = a (task, run) the agents executed more than once (their logs), or a task with
#             more than one run.
#
#   scripts/faults.sh leader-failover
#   FAILOVER_RUNS=1 FAILOVER_TASKS=200 scripts/faults/leader-failover.sh
#
# Each run uses a fresh control plane and kills the leader after a different share of the
# tasks finished (10%, 40%, 70%). FAULTS_BIN_DIR=target/debug uses already-built binaries
# instead of release ones. Needs etcd and the envtest binaries, as the tests do.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${FAULTS_BIN_DIR:-target/release}"
[ -n "${FAULTS_BIN_DIR:-}" ] || scripts/build-release.sh
source scripts/lib/harness.sh
RUNS=${FAILOVER_RUNS:-3}
scratch_workspace

failed=0
points=(0.1 0.4 0.7)
for run in $(seq 1 "$RUNS"); do
  dir="$WORK/run-$run"
  start_control_plane "$dir" "$BIN"
  PIDS+=("$ENVTEST_PID")
  point=${points[$(( (run - 1) % 3 ))]}
  if ! "$PYTHON" scripts/faults/leader_failover_run.py "$BIN" "$dir" "$point" "${FAILOVER_TASKS:-1000}" "$run"; then
    failed=1
  fi
  kill "$ENVTEST_PID" 2>/dev/null || true
  wait "$ENVTEST_PID" 2>/dev/null || true
done
if [ "$failed" -ne 0 ]; then
  echo "leader-failover: FAILED"
  exit 1
fi
echo "leader-failover: every task completed once in each of $RUNS runs"
