#!/usr/bin/env bash
# Heartbeat scale: `propeller standalone` holding N Proplets (default 10,000), each with its
# own Secret, and N simulated proplets (`propeller-loadgen heartbeats`: real MQTT
# connections, each logging in with its own key) heartbeating every 10 s. After a steady
# minute, 1,000 of them go silent (connected, no heartbeats).
#
#   scripts/bench-heartbeats.sh [N]
#
# Reports, from /proc and the standalone API's /metrics:
#   - time from the first connection to all N Running;
#   - steady state (all Running, before the silence): propeller's CPU (% of one core),
#     RSS, Proplet status writes per second and per proplet per flush interval;
#   - time from the silence to all 1,000 Offline (threshold 30 s).
# Every connection costs propeller one file descriptor (and the load generator one); N is
# lowered to what this shell's descriptor limit allows.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
BIN=target/release
# PROPELLER_BIN: another propeller binary to measure (an earlier build, for before/after).
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
N=${1:-10000}
WORK="$(mktemp -d)"
PIDS=()
# The standalone log is kept for a look after the run.
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  cp "$WORK/standalone.log" "${TMPDIR:-/tmp}/bench-heartbeats-standalone.log" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
source scripts/lib/harness.sh
# Room for every simulated proplet and the few other clients (a binary without the setting
# holds 10,000).
fit_proplets_to_descriptors
RUST_LOG=warn,rumqttd=off start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/bench_heartbeats.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "${PIDS[0]}"
