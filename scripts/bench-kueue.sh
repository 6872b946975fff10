#!/usr/bin/env bash
# What Kueue admission adds to a PropellerJob: a real API server, the real Kueue v0.19.2
# (../shared/envtest/kueue), `propeller run --kueue` (release) as its ServiceAccount and two
# real agents. 20 pairs of one-task jobs after warm-ups, a plain one and a Kueue-managed one
# alternating: the median time from just before `kubectl apply` to the task's startedAt (its
# start sent to the device), and the API server's requests per job of each kind by verb and
# resource (its own request counter; every client's, Kueue's and the poller's included).
#
#   scripts/bench-kueue.sh
#
# Needs what the tests need (etcd, the envtest binaries, kubectl).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
cargo test --release -q -p propeller-e2e --test kueue -- --ignored --nocapture \
  bench_what_kueue_adds_from_create_to_first_task_running
