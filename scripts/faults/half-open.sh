#!/usr/bin/env bash
# Fault case: half-open connections. `propeller standalone` (release, default connection cap
# 10,000 and CONNECT deadline 5 s) gets 10,000 sockets that open and stall, of five kinds in
# turn: nothing sent, half a CONNECT, a CONNECT with a wrong key, a TLS ClientHello, half a
# websocket upgrade (`propeller-loadgen half-open`). Meanwhile 20 real devices (each with its
# Proplet and Secret) keep connecting, publishing an acknowledged heartbeat and disconnecting.
#
#   scripts/faults/half-open.sh [STALLED] [DEVICES]
#
# Prints what the broker did with each kind (closed at once, or by its deadline, and when),
# the refusals its /metrics counted, the devices' sessions and CONNACK latency (p50/p99), and
# propeller's RSS and open descriptors before, at peak and after. Fails if a device could not
# get in within 15 s, a stalled socket was left open, or propeller died.
set -euo pipefail
cd "$(dirname "$0")/../.."
# FAULTS_PROFILE=debug runs the debug binaries instead (a quick look; figures are not release).
if [ "${FAULTS_PROFILE:-release}" = debug ]; then
  cargo build -q -p propeller-operator --bin propeller -p propeller-e2e --bin propeller-loadgen
  BIN=target/debug
else
  scripts/build-release.sh
  BIN=target/release
fi
STALLED=${1:-10000}
DEVICES=${2:-20}
# Every stalled socket costs propeller and the load generator one descriptor each.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
echo "descriptor limit: $(ulimit -n)"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  cp "$WORK/standalone.log" "${TMPDIR:-/tmp}/fault-half-open-standalone.log" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
source scripts/lib/harness.sh
MQTT=$(free_port); API=$(free_port)
RUST_LOG=warn,rumqttd=off "$BIN/propeller" standalone --data-dir "$WORK/data" --mqtt-listen "127.0.0.1:$MQTT" \
  --api-listen "127.0.0.1:$API" >"$WORK/standalone.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do [ -s "$WORK/data/api-token" ] && break; sleep 0.1; done

python3 - "$API" "$WORK" "$MQTT" "$BIN" "$STALLED" "$DEVICES" "${PIDS[0]}" <<'PY'
import json, os, subprocess, sys, threading, time
sys.path.insert(0, "scripts")
from bench_api import Api, pick, proplet_manifest, rss_mib
api_port, work, mqtt, bin_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
stalled, devices, pid = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
api = Api(api_port, os.path.join(work, "data"))

def fds():
    return len(os.listdir(f"/proc/{pid}/fd"))

def alive():
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

api.raw("POST", "/v1/apply", "---\n".join(
    proplet_manifest(f"real-{i}", mqtt, f"real-{i}-key") for i in range(devices)))
last = -1
while True:  # the reconcilers settle: credentials in place
    now = pick(api.samples(), "propeller_store_transactions_total")
    if now == last:
        break
    last = now
    time.sleep(1)
before = (rss_mib(pid), fds())
print(f"before: propeller RSS {before[0]:.1f} MiB, {before[1]} open descriptors")

peak = list(before)
done = threading.Event()
def sample():
    while not done.is_set():
        if alive():
            peak[0] = max(peak[0], rss_mib(pid))
            try:
                peak[1] = max(peak[1], fds())
            except OSError:
                pass
        time.sleep(0.1)
sampler = threading.Thread(target=sample)
sampler.start()
gen = subprocess.run([os.path.join(bin_dir, "propeller-loadgen"), "half-open", "--port", mqtt,
                      "--idle", str(stalled), "--devices", str(devices), "--prefix", "real"],
                     stdout=subprocess.PIPE, text=True)
done.set()
sampler.join()
failed = []
if gen.returncode != 0:
    failed.append(f"the load generator failed (exit {gen.returncode})")
summary = None
for line in gen.stdout.splitlines():
    try:
        e = json.loads(line)
    except ValueError:
        continue
    if e.get("event") == "half_open_done":
        summary = e
if not alive():
    print("propeller DIED during the run")
    sys.exit(1)
# jemalloc returns freed pages after its decay time (10 s): "after" is read past it.
time.sleep(12)
after = (rss_mib(pid), fds())
samples = api.samples()
def counted(name, **labels):
    return int(pick(samples, name, **labels))

if summary is None:
    print("no summary from the load generator")
    sys.exit(1)
print(f"stalled sockets: {stalled}, opened in {summary['opened_in_ms']} ms, all closed by the broker "
      f"{summary['all_closed_in_ms']} ms after the first; at most {summary['peak_open_client_side']} open at once")
print("| kind | closed by the broker | of which under 1 s | close p50 | close max | TCP connect failed | left open |")
print("|---|---|---|---|---|---|---|")
for kind, k in summary["kinds"].items():
    print(f"| {kind} | {k['closed_by_broker']} | {k['closed_at_once_under_1s']} | {k['close_ms_p50']} ms | "
          f"{k['close_ms_max']} ms | {k['tcp_connect_failed']} | {k['left_open']} |")
reasons = ["max_connections", "connect_timeout", "closed_before_connect"]
print("broker's own counts (/metrics): refused_connections " +
      ", ".join(f"{r}={counted('propeller_broker_refused_connections_total', reason=r)}" for r in reasons) +
      f"; auth_failures={counted('propeller_broker_auth_failures_total')}"
      f"; keep_alive_expiries={counted('propeller_broker_keep_alive_expiries_total')}")
print(f"real devices: {devices}, sessions {summary['device_sessions']}, refused attempts "
      f"{summary['device_refused_attempts']}, locked out {summary['devices_locked_out']}, heartbeats acked "
      f"{summary['device_heartbeats_acked']}; CONNACK p50 {summary['connack_us_p50']/1000:.2f} ms, "
      f"p99 {summary['connack_us_p99']/1000:.2f} ms, max {summary['connack_us_max']/1000:.2f} ms")
print(f"propeller RSS: before {before[0]:.1f} MiB, peak {peak[0]:.1f} MiB, after {after[0]:.1f} MiB")
print(f"propeller open descriptors: before {before[1]}, peak {peak[1]}, after {after[1]}")
deadline_closed = sum(k["closed_by_broker"] - k["closed_at_once_under_1s"] for k in summary["kinds"].values())
if counted("propeller_broker_refused_connections_total") < deadline_closed:
    failed.append(f"/metrics counted {counted('propeller_broker_refused_connections_total')} refused "
                  f"connections, {deadline_closed} were closed by their deadline")
if after[1] > before[1] + devices + 10:
    failed.append(f"descriptors not released: {before[1]} before, {after[1]} after")
if failed:
    print("FAILED: " + "; ".join(failed))
    sys.exit(1)
PY
