#!/usr/bin/env bash
# Crash in a burst (issue 19): `propeller standalone` with 4 agents and 1,000 add tasks applied
# at once, all on 127.0.0.1.
#
#   scripts/faults.sh crash-burst                  # both variants, 10 propeller kills
#   CRASH_RUNS=3 CRASH_TASKS=200 scripts/faults/crash-burst.sh
#
# 1. propeller killed (-9) at a different point of the burst in each run (right after the apply
#    answered, then after 5% … 95% of the tasks finished), restarted on the same data
#    directory and ports. Every task must end completed exactly once with add(a, b) = a + b:
#    lost = not completed with the right sum, doubled = a (task, run) the agents executed more
#    than once (counted from their logs: executions, not results sent again), stuck = not
#    terminal 120 s after the restart.
# 2. one agent killed (-9) mid-burst and left dead. The tasks carry timeoutSeconds: 20, so a
#    task out on the dead agent fails at its time limit; every other task completes; nothing
#    is left pending or running, and nothing runs twice.
#
# FAULTS_BIN_DIR=target/debug runs already-built binaries there instead of building release
# ones (slower processes, same counts).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${FAULTS_BIN_DIR:-target/release}"
[ -n "${FAULTS_BIN_DIR:-}" ] || scripts/build-release.sh
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
source scripts/lib/harness.sh
"$PYTHON" scripts/faults/crash_burst.py "$BIN" "$WORK"
