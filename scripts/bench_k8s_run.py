"""One Kubernetes-mode measurement for scripts/bench-k8s.sh (see there for what each does).

    bench_k8s_run.py pipeline|heartbeats|baseline N KUBECONFIG MQTT_PORT BIN_DIR PROPELLER_PID APISERVER_PID WORK
"""
import datetime
import json
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import (  # noqa: E402
    cpu_or_zero, cpu_seconds, heartbeat_load, machine_cpu_seconds, parent_of, parse_metrics,
    pid_named, rss_mib,
    start_agent)
from bench_kube import GROUP, Kube, add_task, proplet, secret  # noqa: E402

what, n, kubeconfig, mqtt, bin_dir, propeller_pid, apiserver_pid, work = sys.argv[1:9]
n, propeller_pid, apiserver_pid = int(n), int(propeller_pid), int(apiserver_pid)
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
NS = "default"
kube = Kube(kubeconfig)


def create_many(objects, path_of, threads=8):
    """POSTs every object, `threads` connections at once."""
    local = threading.local()

    def post(obj):
        if not hasattr(local, "kube"):
            local.kube = Kube(kubeconfig)
        local.kube.call("POST", path_of(obj), obj)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(post, objects))


def secrets_path(_):
    return f"/api/v1/namespaces/{NS}/secrets"


def proplets_path(_):
    return f"{GROUP}/namespaces/{NS}/proplets"


def tasks_path(_=None):
    return f"{GROUP}/namespaces/{NS}/tasks"


def wait_running(names, deadline_s=60):
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        items = kube.call("GET", proplets_path(None))["items"]
        running = {p["metadata"]["name"] for p in items if p.get("status", {}).get("phase") == "Running"}
        if set(names) <= running:
            return
        time.sleep(0.2)
    raise SystemExit(f"not all of {names} Running within {deadline_s} s")


def pipeline():
    names = [f"w{i}" for i in range(4)]
    create_many([secret(x, f"{x}-secret") for x in names], secrets_path)
    create_many([proplet(x, mqtt) for x in names], proplets_path)
    agents = [start_agent(bin_dir, x, mqtt, os.path.join(work, x), "warn") for x in names]
    try:
        wait_running(names)
        # 1. One at a time: POST, then the watch event that shows it completed.
        single = []
        for i in range(5 + 30):
            name = f"single-{i}"
            # The watch is open before the POST, so its set-up is not measured.
            rv = kube.call("GET", f"{tasks_path()}?limit=1")["metadata"]["resourceVersion"]
            events = kube.watch(f"{tasks_path()}?fieldSelector=metadata.name%3D{name}", rv)
            t0 = time.perf_counter()
            kube.call("POST", tasks_path(), add_task(name, ADD))
            for event in events:
                if event["object"].get("status", {}).get("phase") == "completed":
                    break
            if i >= 5:
                single.append((time.perf_counter() - t0) * 1000)
        single.sort()
        print(f"| single task, POST -> completed seen on a watch (30 runs) | median "
              f"{statistics.median(single):.1f} ms, p99 {single[-1]:.1f} ms, min {single[0]:.1f} ms "
              f"| <= 50 ms | {'yes' if statistics.median(single) <= 50 else 'no'} |")

        # 2. 1,000 at once.
        rv = kube.call("GET", tasks_path())["metadata"]["resourceVersion"]
        burst = [f"burst-{i}" for i in range(1000)]
        done = {}
        failed = []

        events = kube.watch(tasks_path(), rv)

        def watcher():
            for event in events:
                obj = event["object"]
                name = obj["metadata"]["name"]
                phase = obj.get("status", {}).get("phase")
                if name.startswith("burst-") and phase in ("completed", "failed") and name not in done:
                    done[name] = time.time()
                    if phase == "failed":
                        failed.append(name)
                    if len(done) == len(burst):
                        return

        watch = threading.Thread(target=watcher, daemon=True)
        watch.start()
        requests0 = request_counts()
        cpu0 = (cpu_seconds(propeller_pid), cpu_seconds(apiserver_pid))
        t0 = time.time()
        create_many([add_task(x, ADD) for x in burst], tasks_path)
        posted = time.time()
        watch.join(300)
        cpu1 = (cpu_seconds(propeller_pid), cpu_seconds(apiserver_pid))
        requests1 = request_counts()
        if len(done) < len(burst):
            raise SystemExit(f"only {len(done)} of 1000 finished in 300 s")
        span = max(done.values()) - t0
        rate = 1000 / span
        print(f"| 1,000 tasks POSTed at once (8 connections; POSTs took {posted - t0:.2f} s) | all finished "
              f"{span:.2f} s after the first POST = {rate:.0f} tasks/s, {len(failed)} failed | >= 100 tasks/s "
              f"| {'yes' if rate >= 100 else 'no'} |")
        print(f"CPU during the burst: propeller {cpu1[0] - cpu0[0]:.2f} s, kube-apiserver "
              f"{cpu1[1] - cpu0[1]:.2f} s (of {2 * span:.1f} s on 2 cores)")
        print_requests("API requests during the burst (verb resource/subresource code: count)",
                       requests0, requests1)
    finally:
        for a in agents:
            a.terminate()


def request_counts():
    """The API server's request counter by verb, resource, subresource and code, and its
    request latency sums and counts by verb, resource and subresource (on a connection of
    its own: the sampler thread uses the shared one)."""
    counts = {}
    for name, labels, value in Kube(kubeconfig).metrics():
        if name not in ("apiserver_request_total", "apiserver_request_duration_seconds_sum",
                        "apiserver_request_duration_seconds_count"):
            continue
        field = lambda f: labels.get(f, "")
        what = f'{field("verb")} {field("resource")}/{field("subresource")}'
        key = {"apiserver_request_total": f'{what} {field("code")}',
               "apiserver_request_duration_seconds_sum": ("sum", what),
               "apiserver_request_duration_seconds_count": ("count", what)}[name]
        counts[key] = counts.get(key, 0) + value
    return counts


def print_requests(title, before, after):
    """The requests the API server served between two `request_counts()`, most first, with
    their mean latency inside the API server."""
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"{title}:")
    for k, v in sorted(((k, v) for k, v in diff.items() if isinstance(k, str)), key=lambda kv: -kv[1]):
        if v >= 10:
            what = k.rsplit(" ", 1)[0]
            n = diff.get(("count", what), 0)
            mean = f", mean latency {diff.get(('sum', what), 0) / n * 1000:.1f} ms" if n else ""
            print(f"  {k}: {v:.0f}{mean}")


def status_writes():
    """Proplet status writes the API server has served (PATCH or PUT on proplets/status)."""
    total = 0.0
    for name, labels, value in kube.metrics():
        if (name == "apiserver_request_total" and labels.get("resource") == "proplets"
                and labels.get("subresource") == "status"
                and labels.get("verb") in ("PATCH", "PUT")):
            total += value
    return total


def watch_offline(config, path, rv, out):
    """Puts (name, arrival time, lastSeen) on `out` for each proplet first seen Offline."""
    seen = set()
    for event in Kube(config, timeout=600).watch(path, rv):
        now = time.time()
        obj = event.get("object", {})
        status = obj.get("status", {})
        name = obj.get("metadata", {}).get("name")
        if status.get("phase") == "Offline" and name not in seen:
            seen.add(name)
            last = status.get("lastSeen")
            last = (datetime.datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp()
                    if last else None)
            out.put((name, now, last))


def heartbeats():
    silent = min(1000, n)
    threshold, flush = 30, 5
    t = time.time()
    create_many([secret(f"hb-{i}", f"hb-{i}-key") for i in range(n)], secrets_path)
    create_many([proplet(f"hb-{i}", mqtt, {"bench-silent": "yes" if i < silent else "no"})
                 for i in range(n)], proplets_path)
    print(f"{n} Proplets and Secrets created in {time.time() - t:.1f} s")
    # Settle: the operator adds finalizers and builds credentials.
    time.sleep(10)
    # When each proplet that will go silent is seen Offline: a watch on just them (the
    # others' heartbeat refreshes are budgeted, so the watch keeps up). The Offline status
    # carries the proplet's true lastSeen, so each one's own lateness is measured too.
    # The watch runs in a process of its own: in a thread it waited for the interpreter lock
    # while the sampler parsed the API server's metrics, and its arrival times were late.
    offline_seen = {}
    lateness = []
    silent_path = f"{proplets_path(None)}?labelSelector=bench-silent%3Dyes"
    watch_rv = Kube(kubeconfig).call("GET", silent_path)["metadata"]["resourceVersion"]
    seen_queue = multiprocessing.Queue()
    poller = multiprocessing.Process(target=watch_offline, daemon=True,
                                     args=(kubeconfig, silent_path, watch_rv, seen_queue))
    poller.start()
    samples = []
    # Every quarter second, where the CPU goes (the Offline burst lasts a few seconds); the
    # API server's metrics, which cost it a scrape, once a second.
    burst_cpu = []
    etcd_pid = pid_named("etcd", parent=parent_of(apiserver_pid))
    stop = threading.Event()

    def sample():
        loadgen_pid = None
        tick = 0
        while not stop.is_set():
            loadgen_pid = loadgen_pid or pid_named("propeller-loadgen")
            now, (busy, total) = time.time(), machine_cpu_seconds()
            cpu_p, cpu_a = cpu_seconds(propeller_pid), cpu_seconds(apiserver_pid)
            burst_cpu.append((now, busy, total, cpu_p, cpu_a, cpu_or_zero(etcd_pid),
                              cpu_or_zero(loadgen_pid)))
            if tick % 4 == 0:
                samples.append((now, cpu_p, cpu_a, rss_mib(propeller_pid),
                                rss_mib(apiserver_pid), status_writes()))
            tick += 1
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    requests0 = request_counts()
    # The silence starts in the steady state, once the start-up ramp (every proplet's first
    # Running, written at the API server's pace) is behind: about 100 writes/s here.
    silence_after = 70 + n // 100
    events = heartbeat_load(bin_dir, mqtt, n, silent, threshold, silence_after)
    requests1 = request_counts()
    stop.set()
    sampler.join()
    if "done" not in events:
        raise SystemExit("the load generator failed")
    start = events["connecting"]["unix_ms"] / 1000
    silenced = events["silenced"]["unix_ms"] / 1000
    time.sleep(2)
    poller.terminate()
    poller.join(5)
    while True:
        try:
            name, now, last = seen_queue.get(timeout=0.5)
        except queue.Empty:
            break
        if name not in offline_seen:
            offline_seen[name] = now
            if last is not None:
                lateness.append(now - last - threshold)
    # The load generator disconnects everyone `threshold + 20` s after the silence: only
    # what was Offline before then counts.
    ended = events["done"]["unix_ms"] / 1000
    in_time = sorted(at for at in offline_seen.values() if silenced <= at < ended - 1)
    all_offline = in_time[-1] if len(in_time) >= silent else None
    seen = len(in_time)
    # Steady window: from 20 s after the last connection to the silence.
    steady = [s for s in samples if start + 30 <= s[0] <= silenced]
    if len(steady) < 2:
        raise SystemExit("no steady window")
    a, b = steady[0], steady[-1]
    span = b[0] - a[0]
    cpu_p = (b[1] - a[1]) / span * 100
    cpu_a = (b[2] - a[2]) / span * 100
    writes = (b[5] - a[5]) / span
    per = writes * flush / n
    print()
    print("| measure | figure | target | met |")
    print("|---|---|---|---|")
    print(f"| proplets (real MQTT connections) | {n} | - | - |")
    print(f"| propeller CPU, steady {span:.0f} s | {cpu_p:.1f}% of one core | < 50% | {'yes' if cpu_p < 50 else 'no'} |")
    print(f"| kube-apiserver CPU, same window | {cpu_a:.1f}% of one core | reported | - |")
    print(f"| propeller RSS / kube-apiserver RSS (steady max) | {max(s[3] for s in steady):.0f} / "
          f"{max(s[4] for s in steady):.0f} MiB | reported | - |")
    print(f"| Proplet status writes to the API server | {writes:.0f}/s = {per:.2f} per proplet per {flush} s "
          f"flush interval | <= 1 | {'yes' if per <= 1 else 'no'} |")
    if all_offline:
        took = all_offline - silenced
        print(f"| {silent} silent -> all Offline | {took:.1f} s | <= {threshold} + 2 s | "
              f"{'yes' if took <= threshold + 2 else 'no'} |")
    else:
        print(f"| {silent} silent -> all Offline | {seen} of {silent} before the run ended | "
              f"<= {threshold} + 2 s | no |")
    if lateness:
        lateness.sort()
        pick = lambda q: lateness[min(len(lateness) - 1, int(q * len(lateness)))]
        print(f"| each silent proplet: Offline seen on the watch after its own last heartbeat + "
              f"{threshold} s | median {pick(0.5):.2f} s, p99 {pick(0.99):.2f} s, max {lateness[-1]:.2f} s "
              f"({len(lateness)} proplets) | <= 2 s | {'yes' if lateness[-1] <= 2 else 'no'} |")
    ramp = next((t for t, *_, w in samples if w - samples[0][5] >= n), None)
    if ramp is not None:
        print(f"start-up ramp: {n} Proplet status writes done {ramp - start:.0f} s after the first "
              f"connection; the silence began {silenced - start:.0f} s after it")
    print(f"simulated proplets whose connection the broker closed: {events['done']['failed']} of {n}")
    if in_time:
        print_burst_cpu(burst_cpu, in_time[0] - 0.5, in_time[-1])
    print_offline_delays()
    print_requests("API requests during the load (verb resource/subresource code: count)",
                   requests0, requests1)


def print_burst_cpu(samples, begin, end):
    """Where the machine's CPU went while the silent proplets were being marked Offline."""
    window = [s for s in samples if begin <= s[0] <= end + 0.25]
    if len(window) < 2:
        print("CPU during the Offline burst: too short to sample")
        return
    a, b = window[0], window[-1]
    span = b[0] - a[0]
    cores = (b[2] - a[2]) / span
    share = lambda i: (b[i] - a[i]) / span * 100
    print(f"CPU during the Offline burst ({span:.1f} s, {cores:.1f} cores): machine busy "
          f"{share(1):.0f}% of one core, propeller {share(3):.0f}%, kube-apiserver {share(4):.0f}%, "
          f"etcd {share(5):.0f}%, load generator {share(6):.0f}%")


def print_offline_delays():
    """propeller's own share of the Offline lateness, from its histogram
    `propeller_proplet_offline_delay_seconds` (by stage: reconcile started, status written)."""
    address = os.environ.get("PROPELLER_METRICS")
    if not address:
        return
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    buckets = {}
    for name, labels, value in parse_metrics(text):
        if name != "propeller_proplet_offline_delay_seconds_bucket":
            continue
        buckets.setdefault(labels["stage"], []).append((float(labels["le"]), value))
    for stage, counts in sorted(buckets.items()):
        total = counts[-1][1]
        if not total:
            continue
        bound = lambda q: next(le for le, c in counts if c >= q * total)
        print(f"propeller, {stage.replace('_', ' ')} after the deadline ({total:.0f} proplets): "
              f"median <= {bound(0.5)} s, p99 <= {bound(0.99)} s; by bucket: "
              + ", ".join(f"<={le:g}: {c:.0f}" for le, c in counts))


def baseline():
    """The API server alone, before propeller starts: 1,000 Task POSTs from 8 connections
    (the burst's own requests), then deleted. The ceiling any operator's burst rate sits under
    on this machine."""
    cpu0 = cpu_seconds(apiserver_pid)
    t0 = time.time()
    create_many([add_task(f"baseline-{i}", ADD) for i in range(1000)], tasks_path)
    took = time.time() - t0
    cpu = cpu_seconds(apiserver_pid) - cpu0
    print(f"| baseline: 1,000 Task POSTs, no operator running (8 connections) | {took:.2f} s = "
          f"{1000 / took:.0f} creates/s; kube-apiserver CPU {cpu:.2f} s = {cpu:.1f} ms per request | reported | - |")
    kube.raw("DELETE", tasks_path())
    write_costs()


def write_costs():
    """The API server's CPU per write, by kind, 1,000 of each from 16 connections: what a
    Proplet status write costs it next to a create and next to a built-in object's writes."""
    merge = "application/merge-patch+json"
    maps = f"/api/v1/namespaces/{NS}/configmaps"
    stamp = lambda i: f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z"
    kinds = [
        ("POST configmap", lambda i: ("POST", maps, {"metadata": {"name": f"cost-{i}"}}, None)),
        ("PATCH configmap", lambda i: ("PATCH", f"{maps}/cost-{i}", {"data": {"v": "1"}}, merge)),
        ("POST proplet", lambda i: ("POST", proplets_path(None), proplet(f"cost-{i}", 1883), None)),
        ("PATCH proplet status", lambda i: (
            "PATCH", f"{proplets_path(None)}/cost-{i}/status",
            {"status": {"phase": "Offline", "alive": False, "lastSeen": stamp(i)}}, merge)),
    ]
    local = threading.local()

    def send(request):
        method, path, body, content_type = request
        if not hasattr(local, "kube"):
            local.kube = Kube(kubeconfig)
        local.kube.raw(method, path, json.dumps(body), content_type=content_type or "application/json")

    for kind, request in kinds:
        cpu0, t0 = cpu_seconds(apiserver_pid), time.time()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(send, (request(i) for i in range(1000))))
        took, cpu = time.time() - t0, cpu_seconds(apiserver_pid) - cpu0
        print(f"| API server cost of 1,000 × {kind} (16 connections) | {1000 / took:.0f}/s; "
              f"kube-apiserver CPU {cpu:.1f} ms per request | reported | - |")
    kube.raw("DELETE", maps)
    kube.raw("DELETE", proplets_path(None))


if what == "pipeline":
    pipeline()
elif what == "baseline":
    baseline()
else:
    heartbeats()
