#!/usr/bin/env bash
# Fault case: half-open connections. `propeller standalone` (release, default connection cap
# 10,000 and CONNECT deadline 5 s) gets 10,000 sockets that open and stall, of five kinds in
# turn: nothing sent, half a CONNECT, a CONNECT with a wrong key, a TLS ClientHello, half a
# websocket upgrade (`propeller-loadgen half-open`). Meanwhile 20 real devices (each with its
# Proplet and Secret) keep connecting, publishing an acknowledged heartbeat and disconnecting.
#
#   scripts/faults/half-open.sh [STALLED] [DEVICES]
#
# Prints what the broker did with each kind (closed at once, or by its deadline, and when),
# the refusals its /metrics counted, the devices' sessions and CONNACK latency (p50/p99), and
# propeller's RSS and open descriptors before, at peak and after. Fails if a device could not
# get in within 15 s, a stalled socket was left open, or propeller died.
set -euo pipefail
cd "$(dirname "$0")/../.."
# FAULTS_PROFILE=debug runs the debug binaries instead (a quick look; figures are not release).
if [ "${FAULTS_PROFILE:-release}" = debug ]; then
  cargo build -q -p propeller-operator --bin propeller -p propeller-e2e --bin propeller-loadgen
  BIN=target/debug
else
  scripts/build-release.sh
  BIN=target/release
fi
STALLED=${1:-10000}
DEVICES=${2:-20}
# Every stalled socket costs propeller and the load generator one descriptor each.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
echo "descriptor limit: $(ulimit -n)"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  cp "$WORK/standalone.log" "${TMPDIR:-/tmp}/fault-half-open-standalone.log" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
source scripts/lib/harness.sh
RUST_LOG=warn,rumqttd=off start_standalone "$BIN/propeller" "$WORK/data" "$WORK/standalone.log"
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/faults/half_open.py "$API" "$WORK" "$MQTT" "$BIN" "$STALLED" "$DEVICES" "${PIDS[0]}"
