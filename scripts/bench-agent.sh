#!/usr/bin/env bash
# Agent footprint and latency: stripped binary size, idle RSS against a local broker, and
# cold/warm latency of upstream's add(10, 32) sample and of a WASI "hello" command, in the
# runtime and from start received to result published in the agent.
# Usage: scripts/bench-agent.sh   (builds with the size-tuned `release-agent` profile)
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --profile release-agent -p proplet-agent --bin proplet --example add_latency
cargo build -p propeller-operator --bin propeller
agent=target/release-agent/proplet
# A command component built from source (scripts/guests/hello.rs) for the component figures.
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
hello_component=target/guests/hello.wasm
mkdir -p target/guests
rustc --edition 2021 --target wasm32-wasip2 -C opt-level=s -C debuginfo=0 -C strip=symbols \
  scripts/guests/hello.rs -o "$hello_component"
export HELLO_COMPONENT="$hello_component"

echo "== binary"
file "$agent"
echo "size: $(stat -c %s "$agent") bytes (stripped, $(uname -m))"

echo "== latency"
target/release-agent/examples/add_latency

echo "== idle RSS"
work=$(mktemp -d)
cleanup() { kill "${broker_pid:-}" "${agent_pid:-}" "${sa_pid:-}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
printf '[[client]]\nid = "bench-pi"\nkey = "bench-key"\n' > "$work/credentials.toml"
target/debug/propeller broker --mqtt-listen 127.0.0.1:0 --credentials "$work/credentials.toml" \
  > "$work/broker.out" 2> "$work/broker.err" &
broker_pid=$!
for _ in $(seq 1 100); do
  grep -q "mqtt listening on" "$work/broker.out" 2>/dev/null && break
  sleep 0.1
done
port=$(sed -n 's/.*mqtt listening on .*:\([0-9]*\)$/\1/p' "$work/broker.out")
PROPLET_MQTT_ADDRESS="tcp://127.0.0.1:$port" PROPLET_DOMAIN_ID=d PROPLET_CHANNEL_ID=c \
  PROPLET_CLIENT_ID=bench-pi PROPLET_CLIENT_KEY=bench-key PROPLET_STATE_DIR="$work/state" \
  PROPLET_LOG_LEVEL=warn "$agent" &
agent_pid=$!
sleep 10
grep -q "bench-pi" "$work/broker.err" || { echo "agent did not connect" >&2; exit 1; }
echo "after 10 s connected and idle: $(grep VmRSS /proc/$agent_pid/status | awk '{print $2 " " $3}')"

echo "== start received -> result published, inside the agent (through propeller standalone)"
hello=$(target/release-agent/examples/add_latency --hello-base64)
greet=$(target/release-agent/examples/add_latency --greet-base64)
source scripts/lib/harness.sh
RUST_LOG=warn start_standalone target/debug/propeller "$work/sa" "$work/sa.log"
sa_pid=$STANDALONE_PID
"$PYTHON" scripts/bench_agent.py "$API" "$MQTT" "$work" "$agent" "$hello" "$greet"
kill "$sa_pid" 2>/dev/null || true
