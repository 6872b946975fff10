#!/usr/bin/env bash
# What the Key Broker Service exchange adds to an encrypted task: the real trustee KBS
# (../shared/kbs, sample verifier, loopback), `propeller standalone` and a real agent
# (release builds). After a warm-up of each, 20 pairs of one-shot add tasks, a plain one and
# an encrypted one alternating: the medians of apply-to-completed, and of the exchange alone
# as the agent measured it. Then the agent's stripped binary size.
#
#   scripts/bench-kbs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
cargo test --release -q -p propeller-e2e --test encrypted_tasks -- --ignored --nocapture \
  bench_what_the_kbs_exchange_adds
strip -o target/release/proplet.stripped target/release/proplet
echo "proplet (release, stripped): $(stat -c %s target/release/proplet.stripped) bytes"
