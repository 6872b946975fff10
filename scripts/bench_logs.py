"""The task-log benchmark: N devices printing a line a second on `propeller standalone`.

Run by `scripts/bench-logs.sh`, which starts propeller and passes its ports and pid; see that
script for what is measured."""
import base64, json, os, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, Sampler, fleet_metrics, loadgen, pick, rss_mib, store_fleet
api_port, work, mqtt, bin_dir, n, pid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
api = Api(api_port, os.path.join(work, "data"))
# A module exporting add: what the daemon tasks run never matters, the simulated devices
# do not run it.
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
QUIET = int(os.environ.get("BENCH_QUIET_SECS", "30"))
PRINTING = int(os.environ.get("BENCH_PRINTING_SECS", "60"))


def figures():
    samples = api.samples()
    figures = fleet_metrics(api)
    figures["lines"] = pick(samples, "propeller_broker_messages_in_total", kind="logs")
    return figures


store_fleet(api, mqtt, n)
print(f"{n} Proplets and Secrets stored; RSS {rss_mib(pid):.0f} MiB")
sampler = Sampler(pid, figures, 1.0)
events = {}
run_for = QUIET + PRINTING + 120
gen = threading.Thread(target=lambda: events.update(loadgen(bin_dir, [
    "heartbeats", "--port", str(mqtt), "--proplets", str(n), "--prefix", "hb",
    "--interval-secs", "10", "--log-every-ms", "1000", "--silent", "0",
    "--silence-after-secs", str(run_for), "--run-after-silence-secs", "1"])), daemon=True)
gen.start()
while not sampler.samples or sampler.samples[-1][3]["running"] < n:
    time.sleep(1)
running_at = time.time()
time.sleep(QUIET)
quiet = [s for s in sampler.samples if running_at + 5 <= s[0]]
docs = [f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: t-{i}\n"
        f"spec:\n  name: t-{i}\n  functionName: add\n  file: {ADD}\n  inputs: [1, 2]\n  daemon: true\n"
        f"  propletSelector:\n    propletId: hb-{i}\n" for i in range(n)]
for start in range(0, n, 500):
    api.raw("POST", "/v1/apply", "---\n".join(docs[start:start + 500]))
applied_at = time.time()
# Wait until every device prints: the lines per second reach n (within 5%).
while True:
    s = sampler.samples
    if len(s) > 5 and (s[-1][3]["lines"] - s[-6][3]["lines"]) / (s[-1][0] - s[-6][0]) >= 0.95 * n:
        break
    if time.time() - applied_at > 120:
        raise SystemExit("the devices never all printed")
    time.sleep(1)
printing_at = time.time()
time.sleep(PRINTING)
printing = [s for s in sampler.samples if s[0] >= printing_at]
sampler.stop()
kept = api.raw("GET", "/v1/logs/default/t-0").decode().splitlines()


def window(samples):
    a, b = samples[0], samples[-1]
    span = b[0] - a[0]
    return span, (b[1] - a[1]) / span * 100, max(x[2] for x in samples), (b[3]["lines"] - a[3]["lines"]) / span


q_span, q_cpu, q_rss, _ = window(quiet)
p_span, p_cpu, p_rss, rate = window(printing)
print()
print("| measure | heartbeats only | and every device printing a line a second |")
print("|---|---|---|")
print(f"| devices (real MQTT connections, own credentials) | {n} | {n} |")
print(f"| window | {q_span:.0f} s | {p_span:.0f} s |")
print(f"| log lines received | - | {rate:.0f}/s |")
print(f"| propeller CPU (broker and operator) | {q_cpu:.1f}% of one core | {p_cpu:.1f}% of one core |")
print(f"| propeller RSS (max) | {q_rss:.0f} MiB | {p_rss:.0f} MiB |")
print(f"task t-0's log holds {len(kept)} lines; first {json.loads(kept[0])['text'] if kept else 'none'!r}")
