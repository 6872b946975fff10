#!/usr/bin/env bash
# Task logs at fleet scale: `propeller standalone` with N Proplets (default 1,000), N
# simulated proplets (`propeller-loadgen heartbeats`: real MQTT connections with their own
# keys, heartbeating every 10 s) and a daemon Task pinned to each. Once a proplet gets its
# Task's start it sends one log line a second for it, as an agent does (QoS 1).
#
#   scripts/bench-logs.sh [N]
#
# Reports propeller's CPU (broker and operator are one process) and RSS with the fleet
# heartbeating, before the tasks, and again while every device prints a line a second;
# the lines received per second, and the lines one task's log holds at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
BIN=target/release
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
N=${1:-1000}
source scripts/lib/harness.sh
scratch_workspace
export PROPELLER_MAX_CONNECTIONS=$(( N + 100 ))
RUST_LOG=warn,rumqttd=off start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/bench_logs.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "${PIDS[0]}"
