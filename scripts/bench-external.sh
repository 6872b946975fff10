#!/usr/bin/env bash
# The task pipeline through the embedded broker, a 3-node RabbitMQ cluster and a 3-node NATS
# cluster, side by side on this machine (scripts/bench_external.py says what is measured).
#
#   scripts/bench-external.sh [embedded,rabbitmq,nats]
#
# Needs Debian's rabbitmq-server and nats-server (scripts/test.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-release.sh
exec python3 scripts/bench_external.py target/release "${1:-embedded,rabbitmq,nats}"
