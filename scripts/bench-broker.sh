#!/usr/bin/env bash
# Broker fan-in benchmark: our broker (`propeller broker`) against Debian's mosquitto, both on
# 127.0.0.1, the same load generator and client load, alternating runs, medians and ratios.
#
#   scripts/bench-broker.sh [REPEATS]      (default 3 runs per side and case)
#
# Cases: 1, 100 and 1000 publishers -> 1 subscriber, 200-byte payloads, QoS 0 and QoS 1,
# 20,000 messages per run (split evenly over the publishers).
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS="${1:-3}"
TOTAL=20000

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto
fi
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"

scripts/build-release.sh
BIN=target/release
WORK="$(mktemp -d)"
cleanup() { kill "${OURS_PID:-}" "${MOSQ_PID:-}" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

source scripts/lib/harness.sh

# Our broker: every client has its own credential (service role: may publish anywhere).
{
  for i in $(seq 0 999); do printf '[[client]]\nid = "bench-%d"\nkey = "bench-key"\nrole = "service"\n' "$i"; done
  printf '[[client]]\nid = "bench-sub"\nkey = "bench-key"\nrole = "service"\n'
} > "$WORK/credentials.toml"
OURS_PORT=$(free_port)
"$BIN/propeller" broker --credentials "$WORK/credentials.toml" --mqtt-listen "127.0.0.1:$OURS_PORT" \
  --max-connections 5000 >"$WORK/ours.log" 2>&1 &
OURS_PID=$!

# mosquitto: same port setup, anonymous (it checks no passwords, so it does less work per
# connection than ours), no persistence, no connection limit.
MOSQ_PORT=$(free_port)
cat > "$WORK/mosquitto.conf" <<CONF
listener $MOSQ_PORT 127.0.0.1
allow_anonymous true
persistence false
max_connections -1
max_queued_messages 100000
log_dest none
CONF
"$MOSQUITTO" -c "$WORK/mosquitto.conf" >"$WORK/mosq.log" 2>&1 &
MOSQ_PID=$!
sleep 1
ulimit -n 65536 2>/dev/null || true

run() { # run PORT PUBLISHERS QOS
  "$BIN/propeller-loadgen" fan-in --port "$1" --publishers "$2" --messages $((TOTAL / $2)) --qos "$3" --payload 200 --timeout-secs 120
}

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); mosquitto $("$MOSQUITTO" -h 2>/dev/null | head -n1 | awk '{print $3}')"
RESULTS="$WORK/results.jsonl"
for pubs in 1 100 1000; do
  for qos in 0 1; do
    for rep in $(seq 1 "$REPEATS"); do
      # Alternate which side goes first, so drift on a noisy machine hits both.
      if [ $((rep % 2)) -eq 1 ]; then order="ours mosquitto"; else order="mosquitto ours"; fi
      for side in $order; do
        port=$OURS_PORT; [ "$side" = mosquitto ] && port=$MOSQ_PORT
        line=$(run "$port" "$pubs" "$qos") || line='{"error":"run failed"}'
        echo "{\"side\":\"$side\",\"case\":\"$pubs/$qos\",\"run\":$line}" >> "$RESULTS"
      done
    done
  done
done

"$PYTHON" scripts/bench_broker_report.py "$RESULTS"
