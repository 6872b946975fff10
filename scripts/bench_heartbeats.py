"""The heartbeat-scale benchmark: N heartbeating proplets on `propeller standalone`.

Run by `scripts/bench-heartbeats.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured.

BENCH_PERF=DIR: `perf record` samples propeller for 40 s of the steady window (from 10 s after
all are Running) into DIR/steady.data; BENCH_PERF_CALLGRAPH=dwarf adds call graphs."""
import os, statistics, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, Sampler, fleet_metrics, heartbeat_load, perf_done, perf_record, rss_mib, store_fleet
api_port, work, mqtt, bin_dir, n, pid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
SILENT = min(1000, n)
THRESHOLD, FLUSH = 30, 5
api = Api(api_port, os.path.join(work, "data"))
call = api.raw

def metrics():
    return fleet_metrics(api)

# N Secrets and N Proplets.
t = time.time()
store_fleet(api, mqtt, n)
print(f"{n} Proplets and Secrets stored and reconciled in {time.time() - t:.1f} s; RSS {rss_mib(pid):.0f} MiB")

sampler = Sampler(pid, metrics, 0.5)
samples = sampler.samples  # (time, cpu seconds, rss MiB, metrics)



def profile_steady():
    """Samples the steady window once every proplet is Running (with BENCH_PERF)."""
    deadline = time.time() + 300
    while metrics()["running"] < n and time.time() < deadline:
        time.sleep(1)
    time.sleep(10)
    recorder = perf_record(int(pid), "steady")
    time.sleep(40)
    perf_done(recorder)


if os.environ.get("BENCH_PERF"):
    threading.Thread(target=profile_steady, daemon=True).start()
events = heartbeat_load(bin_dir, mqtt, n, SILENT, THRESHOLD)
sampler.stop()
if "done" not in events:
    raise SystemExit("the load generator failed")
lost = events["done"]["failed"]

start = events["connecting"]["unix_ms"] / 1000
silenced = events["silenced"]["unix_ms"] / 1000
all_running = next((s[0] for s in samples if s[3]["running"] >= n), None)
all_offline = next((s[0] for s in samples if s[0] >= silenced and s[3]["offline"] >= SILENT), None)
steady = [s for s in samples if all_running and all_running + 10 <= s[0] <= silenced]
if len(steady) < 2:
    raise SystemExit("no steady window: the proplets never all ran")
a, b = steady[0], steady[-1]
span = b[0] - a[0]
cpu = (b[1] - a[1]) / span * 100
reports = b[3]["reports"] - a[3]["reports"]
# propeller's whole CPU over the window per report received in it (the broker's work on the
# packet, the decode, the liveness record, and everything else it does at rest).
per_report_us = (b[1] - a[1]) / reports * 1e6 if reports else float("nan")
writes = (b[3]["proplet_writes"] - a[3]["proplet_writes"]) / span
fsyncs = (b[3]["durable"] - a[3]["durable"]) / span
rss = [s[2] for s in steady]
print()
print(f"| measure | figure | target | met |")
print(f"|---|---|---|---|")
print(f"| proplets (real MQTT connections, own credentials) | {n} | 10,000 | {'yes' if n >= 10000 else 'no'} |")
print(f"| first connection -> all {n} Running | {all_running - start:.1f} s | - | - |")
print(f"| propeller CPU, steady {span:.0f} s window | {cpu:.1f}% of one core | < 50% | {'yes' if cpu < 50 else 'no'} |")
print(f"| propeller CPU per report, steady | {per_report_us:.1f} µs ({reports:.0f} reports) | <= 10 µs | {'yes' if per_report_us <= 10 else 'no'} |")
print(f"| propeller RSS, steady (max) | {statistics.median(rss):.0f} MiB ({max(rss):.0f}) | < 300 MiB | {'yes' if max(rss) < 300 else 'no'} |")
print(f"| Proplet status writes | {writes:.0f}/s = {writes * FLUSH / n:.2f} per proplet per {FLUSH} s flush interval ({fsyncs:.0f} fsyncs/s) | <= 1 | {'yes' if writes * FLUSH / n <= 1 else 'no'} |")
if all_offline:
    took = all_offline - silenced
    print(f"| {SILENT} silent -> all Offline | {took:.1f} s | <= {THRESHOLD} + 2 s | {'yes' if took <= THRESHOLD + 2 else 'no'} |")
else:
    print(f"| {SILENT} silent -> all Offline | not within the run | <= {THRESHOLD} + 2 s | no |")
print(f"peak RSS over the whole run: {max(s[2] for s in samples):.0f} MiB")
print(f"simulated proplets whose connection the broker closed during the run: {lost} of {n}")
