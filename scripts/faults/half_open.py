"""The half-open fault case: stalled connections must not hold the broker.

Run by `scripts/faults/half-open.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import json, os, subprocess, sys, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import psutil  # noqa: E402
from bench_api import Api, open_files, pick, proplet_manifest, rss_mib
api_port, work, mqtt, bin_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
stalled, devices, pid = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
api = Api(api_port, os.path.join(work, "data"))

def fds():
    return open_files(pid)

def alive():
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
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
