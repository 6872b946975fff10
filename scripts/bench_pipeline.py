"""The task pipeline benchmark: single-task latency and a 1,000-task burst on 4 agents.

Run by `scripts/bench-pipeline.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import http.client, json, os, statistics, subprocess, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, cpu_seconds, pick, proplet_manifest
api_port, work, mqtt, bin_dir, propeller_pid = sys.argv[1:6]
api = Api(api_port, os.path.join(work, "data"))
call = api.call
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="

agents = []
call("POST", "/v1/apply", "---\n".join(proplet_manifest(f"w{i}", mqtt, f"w{i}-secret") for i in range(4)))
for i in range(4):
    env = dict(os.environ, PROPLET_MQTT_ADDRESS=f"tcp://127.0.0.1:{mqtt}", PROPLET_DOMAIN_ID="d",
               PROPLET_CHANNEL_ID="c", PROPLET_CLIENT_ID=f"w{i}", PROPLET_CLIENT_KEY=f"w{i}-secret",
               PROPLET_STATE_DIR=os.path.join(work, f"w{i}"), RUST_LOG="warn")
    agents.append(subprocess.Popen([os.path.join(bin_dir, "proplet")], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
try:
    deadline = time.time() + 30
    while time.time() < deadline:
        ps = call("GET", "/v1/objects/proplet?namespace=default")
        if sum(1 for p in ps if p.get("status", {}).get("phase") == "Running") == 4:
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the 4 agents did not come up")

    def task(name):
        return (f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
                f"spec:\n  name: {name}\n  functionName: add\n  file: {ADD}\n  inputs: [10, 32]\n")

    # 1. Single task on an idle system: create -> `completed` seen on a watch of the Tasks,
    # as a client waiting for its result sees it; then the same with 1 ms polling, the
    # figure of earlier runs.
    completed_at = {}
    seen = threading.Condition()
    watching = threading.Event()

    def watch_tasks():
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=None)
        conn.request("GET", "/v1/watch/task?namespace=default",
                     headers={"Authorization": f"Bearer {api.token}"})
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"watch: HTTP {response.status} {response.read()[:200]!r}")
        watching.set()
        while line := response.readline():
            obj = json.loads(line).get("object", {})
            if obj.get("status", {}).get("phase") == "completed":
                with seen:
                    completed_at.setdefault(obj["metadata"]["name"], time.perf_counter())
                    seen.notify_all()

    threading.Thread(target=watch_tasks, daemon=True).start()
    if not watching.wait(10):
        raise SystemExit("the task watch did not start")

    def single_runs(prefix, wait_completed):
        latencies = []
        for n in range(5 + 50):
            name = f"{prefix}-{n}"
            t0 = time.perf_counter()
            call("POST", "/v1/apply", task(name))
            finished = wait_completed(name)
            if n >= 5:  # the first few warm the module cache and connections
                latencies.append((finished - t0) * 1000)
        latencies.sort()
        return (f"median {statistics.median(latencies):.1f} ms, "
                f"p99 {latencies[int(0.99 * (len(latencies) - 1))]:.1f} ms, min {latencies[0]:.1f} ms")

    def on_the_watch(name):
        with seen:
            if not seen.wait_for(lambda: name in completed_at, timeout=60):
                raise SystemExit(f"{name} not completed on the watch within 60 s")
            return completed_at[name]

    def polling(name):
        while True:
            t = call("GET", f"/v1/objects/task/default/{name}")
            if t.get("status", {}).get("phase") == "completed":
                return time.perf_counter()
            time.sleep(0.001)

    print(f"single task create -> completed seen on a watch (50 runs): {single_runs('single', on_the_watch)}")
    print(f"single task create -> completed (50 runs, 1 ms polling): {single_runs('polled', polling)}")

    # 2. 1,000 tasks at once.
    names = [f"burst-{n}" for n in range(1000)]
    STORE = ("propeller_store_transactions_total", "propeller_store_durable_commits_total")
    KINDS = ("task", "proplet")
    def store_counters():
        samples = api.samples()
        return [pick(samples, name) for name in STORE] + [
            pick(samples, "propeller_reconciles_total", controller=k) for k in KINDS]
    def finished_count():
        samples = api.samples()
        return sum(pick(samples, "propeller_tasks", phase=p) for p in ("completed", "failed"))
    before = store_counters()
    finished_before = finished_count()
    cpu_before = [cpu_seconds(propeller_pid)] + [cpu_seconds(a.pid) for a in agents]
    t0 = time.time()
    call("POST", "/v1/apply", "---\n".join(task(n) for n in names))
    applied = time.time()
    deadline = t0 + 300
    # Wait on the phase counts in /metrics: listing 1,000 tasks every poll would cost
    # propeller more CPU than the work being measured.
    while time.time() < deadline:
        if finished_count() >= finished_before + 1000:
            break
        time.sleep(0.05)
    else:
        raise SystemExit(f"only {finished_count() - finished_before:.0f} of 1000 finished in 300 s")
    last_seen = time.time()
    cpu_after = [cpu_seconds(propeller_pid)] + [cpu_seconds(a.pid) for a in agents]
    after = store_counters()
    window = last_seen - t0
    tasks = [t for t in call("GET", "/v1/objects/task?namespace=default") if t["metadata"]["name"].startswith("burst-")]
    done = [t for t in tasks if t.get("status", {}).get("phase") in ("completed", "failed")]
    from datetime import datetime
    def ts(s):
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    finished = [ts(t["status"]["finishedAt"]) for t in done]
    created = [ts(t["metadata"]["creationTimestamp"]) for t in done]
    failed = sum(1 for t in done if t["status"]["phase"] != "completed")
    cpu = [a - b for a, b in zip(cpu_after, cpu_before)]
    txns, syncs, task_reconciles, proplet_reconciles = (a - b for a, b in zip(after, before))
    span = max(finished) - t0
    per_task = sorted((f - t0) * 1000 for f in finished)
    print(f"1000 tasks in one apply (answered after {(applied - t0) * 1000:.0f} ms): all finished {span:.2f} s after it "
          f"-> {1000 / span:.0f} tasks/s; apply -> finished p50 {statistics.median(per_task):.0f} ms, "
          f"p99 {per_task[989]:.0f} ms; failed {failed}")
    print(f"store during the burst: {txns:.0f} transactions, {syncs:.0f} fsynced commits "
          f"({txns / max(syncs, 1):.1f} transactions per fsync)")
    print(f"reconciles during the burst: {task_reconciles:.0f} of Tasks, {proplet_reconciles:.0f} of Proplets")
    print(f"CPU during the burst (until the last task was seen finished): propeller {cpu[0]:.2f} s, "
          f"the 4 agents {sum(cpu[1:]):.2f} s, of {2 * window:.2f} s on 2 cores")
finally:
    for a in agents:
        a.terminate()
