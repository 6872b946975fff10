#!/usr/bin/env bash
# Fault case: hostile Wasm against a release `proplet` connected to our broker (issue 19).
# An infinite loop, a memory bomb, unbounded recursion, a trap, a missing import and a 100 MiB
# module (its size announced, and not) must each end their task with an error naming the
# cause, while the agent keeps heartbeating (1 s interval); then the agent must still run
# tasks. Prints per case the error, the time to it against its limit, the heartbeats and the
# longest gap, and the agent's VmRSS idle / peak (VmHWM) / after.
#
# Fails when a case did not fail cleanly, when heartbeats stopped, or when the agent's VmRSS
# after all cases is more than RSS_MARGIN_MIB above its idle figure. The agent runs on glibc's
# malloc (no custom allocator): Wasm linear memory is mapped per task and unmapped when the
# task ends, and the 64 MiB download buffer of the unannounced module is one mmap'd block
# freed whole, so they come back; what may stay is heap the compiler and the blocking-pool
# threads freed into glibc's per-thread arenas (each keeps its top pages) and the cache of
# compiled modules (a few KiB each here). 16 MiB covers those and is a quarter of the
# 64 MiB a single leaked task memory or download buffer would add.
set -euo pipefail
cd "$(dirname "$0")/../.."
RSS_MARGIN_MIB=${RSS_MARGIN_MIB:-16}
scripts/build-release.sh
echo "bad-wasm: release proplet, limits: task time 3 s, task memory 64 MiB, module size 64 MiB; RSS margin ${RSS_MARGIN_MIB} MiB"
BAD_WASM_RSS_MARGIN_MIB=$RSS_MARGIN_MIB cargo test --release -q -p propeller-e2e --test bad_wasm -- --nocapture --test-threads 1 2>&1 \
  | grep -Ev '^(running [0-9]+ tests?|test result:|\s*$)'
