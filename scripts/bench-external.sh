#!/usr/bin/env bash
# The task pipeline through the embedded broker, a 3-node RabbitMQ cluster and a 3-node NATS
# cluster, side by side on this machine (scripts/bench_external.py says what is measured).
#
#   scripts/bench-external.sh [embedded,rabbitmq,nats]
#   BENCH_HEARTBEATS=9900 scripts/bench-external.sh      # and N heartbeating proplets
#
# (The embedded broker of `propeller standalone` takes 10,000 connections: 9,900 simulated
# proplets and the 4 agents fit.)
#
# Needs Debian's rabbitmq-server and nats-server (scripts/test.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
# One socket per simulated proplet, in the load generator and in the broker.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
source scripts/lib/harness.sh
exec "$PYTHON" scripts/bench_external.py target/release "${1:-embedded,rabbitmq,nats}"
