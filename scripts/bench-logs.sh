#!/usr/bin/env bash
# Task logs, two benchmarks on `propeller standalone` (release builds):
#
#   scripts/bench-logs.sh [N]
#
# At fleet scale: N Proplets (default 1,000), N simulated proplets (`propeller-loadgen
# heartbeats`: real MQTT connections with their own keys, heartbeating every 10 s) and a
# daemon Task pinned to each. Once a proplet gets its Task's start it sends one log line a
# second for it, as an agent does (QoS 1). Reports propeller's CPU (broker and operator are
# one process) and RSS with the fleet heartbeating, before the tasks, and again while every
# device prints a line a second; the lines received per second, and the lines one task's
# log holds at the end.
#
#   scripts/bench-logs.sh --one-device [LINES [RUNS]]
#
# The most one device carries: a real agent runs a guest that prints LINES lines (default
# 1,000,000) as fast as it can, as a daemon (so its output is only logged), RUNS times
# (default 3), with the agent's rate and size limits raised out of the way. Reports the time
# from the apply to the last line held by propeller, lines per second end to end, lines
# lost (every line is checked), the MQTT batches, and the agent's and propeller's CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=fleet
if [ "${1:-}" = --one-device ]; then mode=one-device; shift; fi
scripts/build-release.sh
BIN=target/release
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
source scripts/lib/harness.sh
scratch_workspace

if [ "$mode" = one-device ]; then
  LINES=${1:-1000000}
  RUNS=${2:-3}
  # The guest: a core module exporting print(count) (scripts/guests/printer.rs).
  rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
  rustc --target wasm32-wasip1 --crate-type cdylib -O -C strip=symbols -C panic=abort \
    scripts/guests/printer.rs -o "$WORK/printer.wasm"
  # Every line is kept, so that every line can be checked.
  RUST_LOG=warn start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log" \
    --task-log-bytes $(( 256 * 1024 * 1024 )) --task-log-total-bytes $(( 1024 * 1024 * 1024 ))
  PIDS+=("$STANDALONE_PID")
  "$PYTHON" scripts/bench_log_device.py "$API" "$WORK" "$MQTT" "$BIN" "${PIDS[0]}" \
    "$WORK/printer.wasm" "$LINES" "$RUNS"
  exit 0
fi

N=${1:-1000}
export PROPELLER_MAX_CONNECTIONS=$(( N + 100 ))
RUST_LOG=warn,rumqttd=off start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/bench_logs.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "${PIDS[0]}"
