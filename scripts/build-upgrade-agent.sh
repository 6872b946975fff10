#!/usr/bin/env bash
# Builds the second agent that tests/agent_upgrades.rs installs on its devices: the same
# source with PROPLET_BUILD_VERSION=9.9.0-upgrade (the version set at build time), without
# its debug info, as target/upgrade-agent/proplet. Then builds the ordinary agent again, so
# target/debug/proplet reports the crate's own version. scripts/test.sh runs this first.
set -euo pipefail
cd "$(dirname "$0")/.."
# The same command as scripts/test.sh's build, so every other crate is reused.
PROPLET_BUILD_VERSION=9.9.0-upgrade cargo build --workspace --bins --tests
mkdir -p target/upgrade-agent
objcopy --strip-debug target/debug/proplet target/upgrade-agent/proplet.partial
mv target/upgrade-agent/proplet.partial target/upgrade-agent/proplet
cargo build --workspace --bins --tests
echo "target/upgrade-agent/proplet: $(target/upgrade-agent/proplet --version)"
