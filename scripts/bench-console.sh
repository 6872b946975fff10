#!/usr/bin/env bash
# The web console's cost: `propeller standalone` holding N heartbeating Proplets (default
# 10,000; `propeller-loadgen heartbeats`, real MQTT connections), measured in windows that
# alternate between no browser and one headless Chromium (Debian's chromium and
# chromium-driver) signed in to the console's Fleet page, which watches every Proplet.
#
#   scripts/bench-console.sh [N] [WINDOW_SECONDS] [HEARTBEAT_WRITES_PER_SECOND]
#
# HEARTBEAT_WRITES_PER_SECOND is propeller's --heartbeat-writes-per-second (default 20, its
# own default: at 10,000 proplets each lastSeen is rewritten every 500 s); 0 lifts the cap, so
# every proplet's status is written every 5 s (2,000 writes/s, each a watch event to the page).
#
# Reports per window: propeller's CPU (% of one core) and RSS, the browser's CPU, and the
# bytes of watch events propeller sent; then the medians with and without the browser, and
# the size of the console's files.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
BIN=target/release
PROPELLER=${PROPELLER_BIN:-$BIN/propeller}
N=${1:-10000}
WINDOW=${2:-30}
WRITES=${3:-20}
for tool in /usr/bin/chromium /usr/bin/chromedriver; do
  if [ ! -x "$tool" ]; then
    echo "installing chromium chromium-driver" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends chromium chromium-driver >/dev/null
    break
  fi
done
source scripts/lib/harness.sh
fit_proplets_to_descriptors
scratch_workspace
RUST_LOG=warn,rumqttd=off start_standalone "$PROPELLER" "$WORK/data" "$WORK/standalone.log" \
  --liveliness-interval 10s --last-seen-threshold 30s --status-flush-interval 5s \
  --heartbeat-writes-per-second "$WRITES"
PIDS+=("$STANDALONE_PID")
"$PYTHON" scripts/bench_console.py "$API" "$WORK" "$MQTT" "$BIN" "$N" "$STANDALONE_PID" "$WINDOW"
