#!/usr/bin/env bash
# Reconnect storm: `propeller standalone` (release) holding N Proplets (default 5,000), each
# with its own Secret, and N simulated proplets (`propeller-loadgen heartbeats`: real MQTT
# connections with their own keys, a heartbeat every 10 s). After a steady 30 s every
# connection drops at once, with no DISCONNECT (a network blip), and all reconnect within
# 1 s, heartbeating again at once.
#
#   scripts/faults/reconnect-storm.sh [N]
#
# Prints, from /proc and the standalone API's /metrics: the time from the blip until all N
# are Running again (bound: 15 s), how many went Offline meanwhile, Proplet status writes
# in the 10 s after the blip (bound: one per proplet per 5 s flush interval, so 2),
# propeller's CPU and peak RSS around it, and whether
# the broker stayed up and every device got back in. Exits non-zero when a bound is missed.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/build-release.sh
BIN=target/release
N=${1:-5000}
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
LIMIT=$(ulimit -n)
MAX=$(( (LIMIT - 2000) / 2 ))
if [ "$N" -gt "$MAX" ]; then
  echo "note: the descriptor limit here is $LIMIT, which allows $MAX proplets; running $MAX"
  N=$MAX
fi
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  cp "$WORK/standalone.log" "${TMPDIR:-/tmp}/fault-reconnect-storm-standalone.log" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
source scripts/lib/harness.sh
RUST_LOG=warn,rumqttd=off start_standalone "$BIN/propeller" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/faults/reconnect_storm.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "${PIDS[0]}"
