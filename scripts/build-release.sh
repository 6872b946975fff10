#!/usr/bin/env bash
# Release binaries for the benchmarks: propeller, proplet, propeller-loadgen,
# propeller-envtest and propeller-mqtt-cluster. Every bench
# script builds this same set, so cargo resolves the same features and a second script
# reuses the first one's build instead of recompiling Wasmtime and rumqttd.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p propeller-operator --bin propeller -p proplet-agent --bin proplet \
  -p propeller-e2e --bin propeller-loadgen --bin propeller-envtest --bin propeller-mqtt-cluster
