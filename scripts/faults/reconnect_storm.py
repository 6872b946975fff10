"""The reconnect-storm fault case: every connection drops and comes back at once.

Run by `scripts/faults/reconnect-storm.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import psutil  # noqa: E402
from bench_api import Api, Sampler, fleet_metrics, loadgen, store_fleet  # noqa: E402
api_port, work, mqtt, bin_dir, n, pid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
BACK_BOUND_S, WRITES_BOUND = 15, 2
api = Api(api_port, os.path.join(work, "data"))

def metrics():
    return fleet_metrics(api)

t = time.time()
store_fleet(api, mqtt, n)
print(f"{n} Proplets and Secrets stored in {time.time() - t:.1f} s")

sampler = Sampler(pid, metrics, 0.25)
samples = sampler.samples  # (time, cpu seconds, rss MiB, metrics)

events = loadgen(bin_dir, ["heartbeats", "--port", mqtt, "--proplets", str(n), "--prefix", "hb",
                          "--interval-secs", "10", "--storm-after-secs", "30",
                          "--storm-spread-ms", "1000", "--run-after-silence-secs", "20"])
sampler.stop()
time.sleep(0.5)
alive = psutil.pid_exists(pid)
failures = []
if not alive:
    failures.append("propeller died")
if "reconnected" not in events or "done" not in events:
    failures.append("the load generator did not finish: not every device got back in")
    print("\n".join(failures)); sys.exit(1)
blip = events["storm"]["unix_ms"] / 1000
back = events["reconnected"]["unix_ms"] / 1000
before = [s for s in samples if s[0] < blip]
after = [s for s in samples if s[0] >= blip]
steady_running = before[-1][3]["running"]
all_running = next((s[0] for s in after if s[3]["running"] >= n and s[0] > blip + 0.5), None)
max_offline = max(s[3]["offline"] for s in after)
window = [s for s in after if s[0] <= blip + 10]
writes = window[-1][3]["proplet_writes"] - before[-1][3]["proplet_writes"]
span = window[-1][0] - before[-1][0]
cpu = (window[-1][1] - before[-1][1]) / span * 100
rss_before = before[-1][2]
rss_peak = max(s[2] for s in after)
print()
print("| measure | figure | bound |")
print("|---|---|---|")
print(f"| devices (real MQTT connections, own keys) | {n}; Running before the blip: {steady_running:.0f} | - |")
print(f"| blip -> every device reconnected (loadgen) | {back - blip:.2f} s | spread 1 s |")
if all_running:
    print(f"| blip -> all {n} Running again (store) | {all_running - blip:.2f} s | <= {BACK_BOUND_S} s |")
else:
    print(f"| blip -> all {n} Running again (store) | not within the run | <= {BACK_BOUND_S} s |")
    failures.append("not every proplet was Running again")
print(f"| most Offline at once after the blip | {max_offline:.0f} | - |")
print(f"| Proplet status writes in the 10 s after the blip | {writes:.0f} = {writes / n:.2f} per proplet | <= {WRITES_BOUND} per proplet |")
print(f"| propeller CPU over those 10 s | {cpu:.1f}% of one core | reported |")
print(f"| propeller RSS before / peak after | {rss_before:.0f} / {rss_peak:.0f} MiB | reported |")
print(f"| broker up, devices lost at the end | {'yes' if alive else 'no'}, {events['done']['failed']} of {n} | yes, 0 |")
if all_running and all_running - blip > BACK_BOUND_S:
    failures.append(f"Running again after {all_running - blip:.1f} s")
if writes / n > WRITES_BOUND:
    failures.append(f"{writes / n:.2f} status writes per proplet")
if events["done"]["failed"]:
    failures.append("devices lost")
if failures:
    print("FAILED: " + "; ".join(failures)); sys.exit(1)
print("reconnect storm: passed")
