#!/usr/bin/env bash
# Runs the whole test suite. The end-to-end tests in tests/ start the real binaries, so
# those are built first.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
cargo nextest run --workspace --no-fail-fast "$@"
