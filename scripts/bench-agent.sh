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
api_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
mqtt_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
RUST_LOG=warn target/debug/propeller standalone --data-dir "$work/sa" --mqtt-listen "127.0.0.1:$mqtt_port" \
  --api-listen "127.0.0.1:$api_port" > "$work/sa.log" 2>&1 &
sa_pid=$!
for _ in $(seq 1 100); do [ -s "$work/sa/api-token" ] && break; sleep 0.1; done
python3 - "$api_port" "$mqtt_port" "$work" "$agent" "$hello" "$greet" <<'PY'
import json, os, re, statistics, subprocess, sys, time
sys.path.insert(0, "scripts")
from bench_api import Api, proplet_manifest
api, mqtt, work, agent, hello, greet = sys.argv[1:7]
call = Api(api, os.path.join(work, "sa")).call
call("POST", "/v1/apply", proplet_manifest("pi", mqtt, "pi-secret"))
log = open(os.path.join(work, "agent-debug.log"), "w")
env = dict(os.environ, PROPLET_MQTT_ADDRESS=f"tcp://127.0.0.1:{mqtt}", PROPLET_DOMAIN_ID="d", PROPLET_CHANNEL_ID="c",
           PROPLET_CLIENT_ID="pi", PROPLET_CLIENT_KEY="pi-secret", PROPLET_STATE_DIR=os.path.join(work, "pi"),
           RUST_LOG="warn,proplet_agent=debug", NO_COLOR="1")
proc = subprocess.Popen([agent], env=env, stdout=log, stderr=subprocess.STDOUT)
try:
    for _ in range(300):
        if call("GET", "/v1/objects/proplet/default/pi").get("status", {}).get("phase") == "Running":
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the agent did not come up")
    ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
    def run(name, function, file, inputs):
        call("POST", "/v1/apply", f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
             f"spec:\n  name: {name}\n  functionName: {function}\n  file: {file}\n  inputs: {inputs}\n")
        while True:
            t = call("GET", f"/v1/objects/task/default/{name}")
            if t.get("status", {}).get("phase") in ("completed", "failed"):
                if t["status"]["phase"] != "completed":
                    raise SystemExit(f"{name}: {t['status']}")
                return t["metadata"]["uid"]
            time.sleep(0.005)
    uids = {"add": [], "hello": [], "greet": []}
    for i in range(51):
        uids["add"].append(run(f"add-{i}", "add", ADD, "[10, 32]"))
    for i in range(51):
        uids["hello"].append(run(f"hello-{i}", "_start", hello, "[]"))
    for i in range(51):
        uids["greet"].append(run(f"greet-{i}", "greet", greet, json.dumps(['"John Doe"'])))
    time.sleep(0.5)
finally:
    proc.terminate()
    proc.wait()
    log.close()
took = {}
for line in open(os.path.join(work, "agent-debug.log")):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.search(r'result published task_id="?([^" ]+)"? turnaround_us=(\d+)', line)
    if m:
        took[m.group(1)] = int(m.group(2))
labels = {"add": "add(10, 32)", "hello": "WASI hello", "greet": "component greet (custom export, WAVE)"}
for what in ("add", "hello", "greet"):
    times = [took.get(u) for u in uids[what]]
    if any(t is None for t in times):
        raise SystemExit(f"missing turnaround lines for {what}")
    warm = sorted(times[1:])
    label = labels[what]
    print(f"{label}: cold (first, compiles) {times[0]} us; warm median {statistics.median(warm):.0f} us, "
          f"p99 {warm[int(0.99 * (len(warm) - 1))]} us (50 runs)")
PY
kill "$sa_pid" 2>/dev/null || true
