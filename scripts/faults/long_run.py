"""One run of scripts/faults/long-run.sh (see there for what it does and checks).

    long_run.py API_PORT WORK MQTT_PORT BIN_DIR PROPLETS PROPELLER_PID MINUTES RATE SAMPLE_SECS PLOT
"""
import datetime, os, statistics, sys, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_api import Api, cpu_seconds, fleet_metrics, loadgen, open_files, rss_mib, start_agent, store_fleet

api_port, work, mqtt, bin_dir = sys.argv[1:5]
n, pid, minutes, rate, every = int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
plot_path = sys.argv[10]
TTL = int(os.environ.get("LONG_RUN_TTL", "120"))
WORKERS = 4
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
data = os.path.join(work, "data")
store_file = os.path.join(data, "objects.redb")


def worker_manifest(name):
    return (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-secret\n"
            f"---\napiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\n"
            f"  labels: {{role: worker}}\nspec:\n  type: external\n  connectionConfig:\n"
            f"    mqttAddress: tcp://127.0.0.1:{mqtt}\n    domainId: d\n    channelId: c\n    clientId: {name}\n"
            f"    clientKeySecretRef: {{name: {name}-key, key: key}}\n")


def task(i):
    return (f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: lr-{i}\n"
            f"spec:\n  name: lr-{i}\n  functionName: add\n  file: {ADD}\n  inputs: [{i}, 1]\n"
            f"  ttlSecondsAfterFinished: {TTL}\n  propletSelector:\n    matchLabels: {{role: worker}}\n")


api = Api(api_port, data)
t0 = time.time()
store_fleet(api, mqtt, n)
api.raw("POST", "/v1/apply", "---\n".join(worker_manifest(f"w{i}") for i in range(WORKERS)))
logs = os.environ.get("LONG_RUN_LOGS")  # a directory to keep the agents' logs in
agents = [start_agent(bin_dir, f"w{i}", mqtt, os.path.join(work, f"w{i}"), rust_log="info" if logs else "warn",
                      log_path=os.path.join(logs, f"w{i}.log") if logs else None)
          for i in range(WORKERS)]
run_secs = minutes * 60
beats = threading.Thread(target=loadgen, daemon=True, args=(bin_dir, [
    "heartbeats", "--port", str(mqtt), "--proplets", str(n), "--prefix", "hb", "--interval-secs", "10",
    "--silent", "0", "--silence-after-secs", str(int(run_secs + 120)), "--run-after-silence-secs", "0"]))
beats.start()
deadline = time.time() + 600
while fleet_metrics(api)["running"] < n + WORKERS:
    if time.time() > deadline:
        raise SystemExit(f"only {fleet_metrics(api)['running']} of {n + WORKERS} proplets Running")
    time.sleep(1)
print(f"{n} heartbeating proplets and {WORKERS} agents Running {time.time() - t0:.0f} s after the start; "
      f"{rate} tasks/s for {minutes:g} min, TTL {TTL} s, a sample every {every} s", flush=True)

sent = {}          # task name -> POST time
seen = {}          # task name -> (phase, latency s)
lock = threading.Lock()
stop = threading.Event()
post_errors = []


def produce():
    producer = Api(api_port, data)
    i = 0
    start = time.time()
    while not stop.is_set():
        batch = list(range(i, i + rate))
        at = time.time()
        try:
            producer.raw("POST", "/v1/apply", "---\n".join(task(k) for k in batch))
        except SystemExit as e:  # kept_alive_request ends on a non-2xx answer
            post_errors.append(str(e))
            return
        with lock:
            for k in batch:
                sent[f"lr-{k}"] = at
        i += rate
        stop.wait(max(0.0, start + i / rate - time.time()))


def parse(ts):
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def look(reader):
    """Records every finished lr- task the store holds; how many lr- tasks it holds."""
    tasks = reader.call("GET", "/v1/objects/task?namespace=default")
    held = 0
    for t in tasks:
        name = t["metadata"]["name"]
        if not name.startswith("lr-"):
            continue
        held += 1
        status = t.get("status", {})
        if status.get("phase") in ("completed", "failed") and status.get("finishedAt"):
            with lock:
                if name not in seen and name in sent:
                    seen[name] = (status["phase"], parse(status["finishedAt"]) - sent[name],
                                  status.get("results"))
    return held


producer = threading.Thread(target=produce, daemon=True)
reader = Api(api_port, data)
samples = []  # minute, rss, fds, cpu %, store MiB, held, p50 ms, p99 ms, created, done
start = time.time()
last_cpu, last_t = cpu_seconds(pid), start
producer.start()
next_look = start
next_sample = start + every
while time.time() < start + run_secs:
    time.sleep(max(0.0, min(next_look, next_sample) - time.time()))
    now = time.time()
    if now >= next_look:
        held = look(reader)
        next_look += min(20, every / 2)
    if now >= next_sample:
        cpu = cpu_seconds(pid)
        with lock:
            # The tasks created the window before last: every one of them has finished
            # and been looked at by now unless it is slow, which is what p99 is for.
            window = [lat for name, (_, lat, _) in seen.items()
                      if next_sample - 2 * every <= sent[name] < next_sample - every]
            created, done = len(sent), len(seen)
        window.sort()
        p50 = window[len(window) // 2] * 1000 if window else float("nan")
        p99 = window[min(len(window) - 1, int(len(window) * 0.99))] * 1000 if window else float("nan")
        row = ((now - start) / 60, rss_mib(pid), open_files(pid), (cpu - last_cpu) / (now - last_t) * 100,
               os.path.getsize(store_file) / 2**20, held, p50, p99, created, done)
        samples.append(row)
        last_cpu, last_t = cpu, now
        print(f"min {row[0]:6.1f}: RSS {row[1]:6.1f} MiB, {row[2]} fds, CPU {row[3]:5.1f}%, store {row[4]:6.1f} MiB "
              f"holding {row[5]} tasks, latency p50 {row[6]:6.1f} ms p99 {row[7]:6.1f} ms "
              f"(of {len(window)} tasks created the window before), {created} created, {done} finished", flush=True)
        next_sample += every
stop.set()
producer.join()
# Stragglers: everything created has finished within a minute, or is lost.
grace = time.time() + 60
while time.time() < grace:
    held = look(reader)
    with lock:
        if all(name in seen for name in sent):
            break
    time.sleep(5)
remaining = reader.call("GET", "/v1/objects/task?namespace=default")
stuck = [t for t in remaining if t["metadata"]["name"].startswith("lr-")
         and t.get("status", {}).get("phase") not in ("completed", "failed")]
for t in stuck[:3]:
    print(f"not finished: {t['metadata']['name']}: {t.get('status')}")
for a in agents:
    a.terminate()
import psutil
for child in psutil.Process().children():
    if child.name().startswith("propeller-load"):
        child.terminate()

with lock:
    created = len(sent)
    completed = sum(1 for p, _, _ in seen.values() if p == "completed")
    failed = sum(1 for p, _, _ in seen.values() if p == "failed")
    wrong = sum(1 for name, (p, _, r) in seen.items()
                if p == "completed" and r != str(int(name[3:]) + 1))
    unseen = created - len(seen)


def slope(rows, column):
    """Least-squares slope of `column` against minutes, per hour."""
    xs = [r[0] for r in rows if r[column] == r[column]]
    ys = [r[column] for r in rows if r[column] == r[column]]
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 60 if den else float("nan")


# The store fills for the first TTL + a minute; the trend is judged after that, and over the
# second half on its own.
settled = [r for r in samples if r[0] * 60 >= TTL + 60] or samples
second = samples[len(samples) // 2:]
names = {1: ("RSS", "MiB"), 2: ("descriptors", ""), 4: ("store file", "MiB"), 5: ("Tasks held", ""),
         7: ("latency p99", "ms")}
print()
print(f"| figure | first settled sample | last sample | slope after the first {TTL + 60} s | slope over the second half |")
print("|---|---|---|---|---|")
for col, (label, unit) in names.items():
    first, last = settled[0][col], samples[-1][col]
    print(f"| {label} | {first:.1f} {unit} | {last:.1f} {unit} | {slope(settled, col):+.2f} {unit}/h | "
          f"{slope(second, col):+.2f} {unit}/h |")
cpus = [r[3] for r in settled]
lat50 = [r[6] for r in settled if r[6] == r[6]]
print(f"\nCPU {statistics.median(cpus):.1f}% of a core (median of samples); latency p50 median "
      f"{statistics.median(lat50) if lat50 else float('nan'):.1f} ms")
print(f"created {created}, completed {completed}, failed {failed}, wrong results {wrong}, "
      f"deleted before a look saw them finished {unseen - len(stuck)}, not finished {len(stuck)}, "
      f"POST errors {len(post_errors)}")

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    xs = [r[0] for r in samples]
    axes[0].plot(xs, [r[1] for r in samples]); axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(xs, [r[2] for r in samples]); axes[1].set_ylabel("descriptors")
    axes[2].plot(xs, [r[4] for r in samples], label="store file (MiB)")
    axes[2].plot(xs, [r[5] / 100 for r in samples], label="Tasks held (hundreds)")
    axes[2].legend(loc="lower right"); axes[2].set_ylabel("store")
    axes[3].plot(xs, [r[6] for r in samples], label="p50")
    axes[3].plot(xs, [r[7] for r in samples], label="p99")
    axes[3].legend(loc="upper right"); axes[3].set_ylabel("latency (ms)"); axes[3].set_xlabel("minutes")
    fig.suptitle(f"propeller standalone: {n} heartbeating proplets, {rate} tasks/s, TTL {TTL} s")
    fig.tight_layout()
    os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
    fig.savefig(plot_path, dpi=80)
    print(f"plot: {plot_path}")
except ImportError:
    print("plot: matplotlib is not installed (python3-matplotlib)")

problems = []
if failed or wrong or stuck or post_errors:
    problems.append(f"{failed} failed, {wrong} wrong, {len(stuck)} not finished, POST errors {post_errors[:1]}")
bound = rate * (TTL + 120)
if max(r[5] for r in settled) > bound:
    problems.append(f"the store held {max(r[5] for r in settled)} tasks, over {bound}")
max_rss = float(os.environ.get("LONG_RUN_MAX_RSS_SLOPE", "10"))
if minutes >= 30 and slope(second, 1) > max_rss:
    problems.append(f"RSS grows {slope(second, 1):.1f} MiB/h over the second half")
if minutes >= 30 and slope(second, 2) > 10:
    problems.append(f"descriptors grow {slope(second, 2):.1f}/h over the second half")
if problems:
    raise SystemExit("long-run: FAILED: " + "; ".join(problems))
print("long-run: passed")
