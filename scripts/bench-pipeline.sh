#!/usr/bin/env bash
# Task pipeline benchmark: `propeller standalone` with 4 local agents, all on 127.0.0.1.
#
#   scripts/bench-pipeline.sh
#
# 1. One add(10, 32) at a time on the idle system, 50 times: create (the API's answer to
#    the apply) -> completed as a watch of the Tasks shows it, median and p99; then the same
#    with the first poll (every millisecond) that sees it instead of the watch.
# 2. 1,000 add tasks applied in one request: tasks/s from the apply to the last completion,
#    and per-task create -> finish from the status timestamps (p50, p99).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
BIN=target/release
# PROPELLER_BIN: another propeller binary to measure (an earlier build, for before/after).
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
WORK="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
source scripts/lib/harness.sh
RUST_LOG=warn start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log"
PIDS+=("$STANDALONE_PID")

"$PYTHON" scripts/bench_pipeline.py "$API" "$WORK" "$MQTT" "$BIN" "${PIDS[0]}"
