#!/usr/bin/env bash
# Fault case: a long run (issue 47). `propeller standalone` (release) holding 1,000
# heartbeating proplets (`propeller-loadgen heartbeats`: real MQTT connections with their
# own keys, every 10 s) and 4 real agents, taking 20 add tasks a second (each with
# `ttlSecondsAfterFinished: 60`, the retention) for 2 hours. Every minute it samples
# propeller's RSS, descriptors, CPU, the store file's size, the Tasks the store holds and the
# latency of the tasks created in that minute (POST -> completed, p50/p99, from their
# `finishedAt`). At the end it prints each figure's least-squares slope over the run (per
# hour), the counts (created, completed, lost, failed) and writes a plot (matplotlib, from
# Debian's python3-matplotlib) to LONG_RUN_PLOT (default docs/src/images/long-run.png).
#
# Fails when a task is lost or failed, when the store's Task count is not bounded by the
# retention (more than 2 minutes of tasks), or when the RSS or descriptor slope over the
# second half exceeds LONG_RUN_MAX_RSS_SLOPE MiB/h (default 10) or 10 descriptors/h.
#
#   scripts/faults.sh long-run
#   LONG_RUN_MINUTES=2 LONG_RUN_SAMPLE_SECS=10 FAULTS_BIN_DIR=target/debug scripts/faults/long-run.sh
#
# The second line is CI's 2-minute version, on the debug binaries (its figures are a check
# that the case runs, not the measurement). FAULTS_BIN_DIR uses already-built binaries.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${FAULTS_BIN_DIR:-target/release}"
[ -n "${FAULTS_BIN_DIR:-}" ] || scripts/build-release.sh
source scripts/lib/harness.sh
N=${LONG_RUN_PROPLETS:-1000}
fit_proplets_to_descriptors
scratch_workspace
if ! "$PYTHON" -c 'import matplotlib' 2>/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -qq python3-matplotlib >/dev/null \
    || echo "note: python3-matplotlib could not be installed; the run goes on without its plot"
fi
RUST_LOG=${LONG_RUN_RUST_LOG:-warn,rumqttd=off} start_standalone "$BIN/propeller" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s
PIDS+=("$STANDALONE_PID")
status=0
"$PYTHON" scripts/faults/long_run.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "$STANDALONE_PID" \
  "${LONG_RUN_MINUTES:-120}" "${LONG_RUN_RATE:-20}" "${LONG_RUN_SAMPLE_SECS:-60}" \
  "${LONG_RUN_PLOT:-docs/src/images/long-run.png}" || status=$?
# LONG_RUN_LOGS: a directory to keep propeller's and the agents' logs in.
if [ -n "${LONG_RUN_LOGS:-}" ]; then cp "$WORK/standalone.log" "$LONG_RUN_LOGS/"; fi
exit "$status"
