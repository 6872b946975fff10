"""One sharded measurement for scripts/bench-shard.sh: REPLICAS `propeller run --shard`
replicas on a real kube-apiserver and a 3-node NATS cluster (rendered device authorization).

    bench_shard.py BIN_DIR N REPLICAS WORK APISERVER_PID

1. N Proplets with their Secrets, stored before the replicas start (`replicas_ready_s`: until
   every replica acts on all members), and N simulated proplets (`propeller-loadgen
   heartbeats`, in processes of at most 15,000 connections each: the descriptor limit here is
   20,000) heartbeating every 10 s through the cluster: the time until all are Running, then
   over a steady 40 s each replica's CPU and RSS, the brokers' and the API server's CPU, and
   the Proplet status writes the API server served.
2. 4 real agents and 1,000 Tasks POSTed at once from 8 connections: tasks/s from the first
   POST to the last completion (a list polled every 0.5 s), the API server's requests per task (the
   user's POSTs included), each replica's CPU and reconciles during the burst, and what each
   replica owns.

PROPELLER_BIN: the propeller binary to measure instead of BIN_DIR's (before/after).
BENCH_NAMESPACES=K: the proplets and tasks spread over K namespaces, one real agent in each
(default 1: `default`, with 4 agents).
BENCH_SHARDED_WATCHES=1: the replicas run with --sharded-watches (the control plane must have
the API server's ShardedListAndWatch gate: bench-shard.sh turns it on then).
BENCH_PERF=DIR: `perf record` samples the first replica (cpu-clock, 499 Hz) during the
steady window and during the burst, into DIR/steady.data and DIR/burst.data (`perf report
-i DIR/burst.data --no-children`); BENCH_PERF_CALLGRAPH=dwarf adds call graphs (for a
build with debug info, such as PROPELLER_BIN=target/debug/propeller).
"""
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import children_of, cpu_or_zero, free_port, parse_metrics, perf_done, perf_record, pick, rss_mib  # noqa: E402
from bench_kube import GROUP, Kube, add_task  # noqa: E402


bin_dir, n, replicas, work, apiserver_pid = sys.argv[1:6]
n, replicas, apiserver_pid = int(n), int(replicas), int(apiserver_pid)
admin = Kube(os.path.join(work, "admin.kubeconfig"))
K = int(os.environ.get("BENCH_NAMESPACES", "1"))
# Words, not `bench-<i>`: the API server's namespace hash (FNV-1a) puts names that differ
# only in their last character in one range, so `bench-0` ... `bench-7` would all fall to
# one replica with --sharded-watches. These eight fall 3/3/2 over members r0, r1, r2.
WORDS = ["red", "green", "white", "amber", "cedar", "indigo", "juniper", "delta"]
NAMESPACES = ([WORDS[i] if i < len(WORDS) else f"bench-{i}" for i in range(K)]
              if K > 1 else ["default"])
SHARDED = os.environ.get("BENCH_SHARDED_WATCHES") == "1"
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
PASSWORD = "bench-propeller-password"
AGENTS = K if K > 1 else 4
# Another propeller binary to measure (an earlier build, for before/after).
PROPELLER = os.environ.get("PROPELLER_BIN") or os.path.join(bin_dir, "propeller")
PER_LOADGEN = 15000


def objects(name, brokers, channel, ns):
    """A device's Secret and external Proplet, in namespace `ns`."""
    return [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-key", "namespace": ns},
             "stringData": {"key": f"{name}-key" if channel == "c" else f"{name}-secret"}},
            {"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
             "metadata": {"name": name, "namespace": ns,
                          "labels": {"bench-role": "heartbeat" if channel == "c" else "worker"}},
             "spec": {"type": "external", "connectionConfig": {
                 "mqttAddress": brokers, "domainId": "d", "channelId": channel, "clientId": name,
                 "clientKeySecretRef": {"name": f"{name}-key", "key": "key"}}}}]


def worker_task(name, ns):
    """add(10, 32) in namespace `ns` on one of the real agents (the simulated proplets run
    nothing)."""
    task = add_task(name, ADD)
    task["metadata"]["namespace"] = ns
    task["spec"]["propletSelector"] = {"matchLabels": {"bench-role": "worker"}}
    return task


def create_many(docs, threads=8):
    local = threading.local()

    def post(doc):
        if not hasattr(local, "kube"):
            local.kube = Kube(os.path.join(work, "admin.kubeconfig"))
        ns = doc["metadata"]["namespace"]
        if doc["kind"] == "Secret":
            path = f"/api/v1/namespaces/{ns}/secrets"
        else:
            path = f"{GROUP}/namespaces/{ns}/{doc['kind'].lower()}s"
        local.kube.call("POST", path, doc)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(post, docs))


def metrics_of(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def api_requests():
    """Requests the API server has served so far, and its proplet status writes."""
    total = writes = 0.0
    for name, labels, value in admin.metrics():
        if name != "apiserver_request_total" or labels.get("verb") in ("WATCH", "LIST", "GET"):
            continue
        total += value
        if labels.get("resource") == "proplets" and labels.get("subresource") == "status":
            writes += value
    return total, writes


def requests_by_kind():
    """Write requests the API server has served, by verb, resource/subresource and code."""
    counts = {}
    for name, labels, value in admin.metrics():
        if name == "apiserver_request_total" and labels.get("verb") not in ("WATCH", "LIST", "GET"):
            key = f'{labels.get("verb")} {labels.get("resource")}/{labels.get("subresource", "")} {labels.get("code")}'
            counts[key] = counts.get(key, 0) + value
    return counts


def mqtt_accepts(port, user, password):
    """Whether the MQTT listener on `port` accepts `user` (MQTT 3.1.1 CONNECT, CONNACK code 0)."""
    def field(text):
        data = text.encode()
        return struct.pack("!H", len(data)) + data
    body = field("MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 30) + field(f"probe-{user}") \
        + field(user) + field(password)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(bytes([0x10, len(body)]) + body)
            ack = s.recv(4)
            return len(ack) == 4 and ack[0] == 0x20 and ack[3] == 0
    except OSError:
        return False


def wait_until(what, check, limit):
    deadline = time.time() + limit
    while not check():
        if time.time() > deadline:
            raise SystemExit(f"{replicas} replica(s): {what} not within {limit} s")
        time.sleep(0.5)


def main():
    # The cluster.
    initial = os.path.join(work, "authorization.conf")
    with open(initial, "w") as f:
        f.write(f'authorization {{\n  users: [\n    {{ user: "propeller", password: "{PASSWORD}" }}\n  ]\n}}\n')
    cluster = subprocess.Popen([os.path.join(bin_dir, "propeller-mqtt-cluster"), "nats", "--authorization",
                                initial, "--user", "propeller", "--password", PASSWORD],
                               stdout=subprocess.PIPE, text=True)
    info = json.loads(cluster.stdout.readline())
    nodes = [f"mqtt://{a}" for a in info["mqtt"]]
    brokers = ",".join(nodes)
    broker_pids = children_of(cluster.pid)
    authorization = info["authorization"]
    password_file = os.path.join(work, "mqtt-password")
    with open(password_file, "w") as f:
        f.write(PASSWORD)
    procs, loadgens, agents = [], [], []
    try:
        # 1. N heartbeating proplets: their Secrets and Proplets stored first, then the
        # replicas started on them (created while replicas run, each new device re-rendered
        # the brokers' authorization and reloaded 3 nodes: 17 minutes for 30,000 here).
        for ns in NAMESPACES:
            if ns != "default":
                admin.call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": ns}})
        t = time.time()
        names = [f"hb-{i}" for i in range(n)]
        docs = [d for i, x in enumerate(names) for d in objects(x, brokers, "c", NAMESPACES[i % K])]
        create_many([d for d in docs if d["kind"] == "Secret"])
        create_many([d for d in docs if d["kind"] == "Proplet"])
        created = time.time() - t

        # The replicas: one renders the NATS authorization.
        ports = []
        for i in range(replicas):
            metrics = free_port()
            args = [PROPELLER, "run", "--shard", "--lease-namespace", "propeller-system",
                    "--metrics-listen", f"127.0.0.1:{metrics}", "--liveliness-interval", "10s",
                    "--last-seen-threshold", "30s", "--status-flush-interval", "5s",
                    "--mqtt-broker", brokers, "--mqtt-username", "propeller", "--mqtt-password-file", password_file,
                    "--device-auth", "rendered"] + (["--sharded-watches"] if SHARDED else [])
            if i == 0:
                reload = "kill -HUP " + " ".join(str(p) for p in info["pids"]) + "; true"
                args += ["--broker-config-file", authorization, "--broker-config-reload", reload]
            log = open(os.path.join(work, f"propeller-{i}.log"), "w")
            env = dict(os.environ, KUBECONFIG=os.path.join(work, "propeller.kubeconfig"),
                       HOSTNAME=f"r{i}", RUST_LOG=os.environ.get("BENCH_RUST_LOG", "warn"))
            procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
            ports.append(metrics)

        def members_ok():
            try:
                return all(pick(metrics_of(p), "propeller_shard_members") == replicas for p in ports)
            except OSError:
                return False

        t = time.time()
        wait_until("every replica acting on all members", members_ok, 600)
        ready = time.time() - t

        def rendered(names):
            with open(authorization) as f:
                text = f.read()
            return all(f'"{x}"' in text for x in names)
        wait_until("the authorization rendered", lambda: rendered([names[-1]]), 300)
        ports_csv = ",".join(a.rsplit(":", 1)[1] for a in info["mqtt"])
        # The nodes reload the rendering (30,000 users take them a while): the load generator
        # stops at its first refused login, so it starts once every node takes the last device.
        wait_until("every node accepting the fleet's logins",
                   lambda: all(mqtt_accepts(int(p), names[-1], f"{names[-1]}-key") for p in ports_csv.split(",")),
                   300)
        started = time.time()
        for first in range(0, n, PER_LOADGEN):
            count = min(PER_LOADGEN, n - first)
            # Each process's proplets are `hb-<first + i>`: prefix `hb`, an offset by name.
            # They beat until stopped at the end (at 30,000 reaching Running took about
            # 600 s here, when a 600 s load had stopped under the steady window).
            loadgens.append(subprocess.Popen(
                [os.path.join(bin_dir, "propeller-loadgen"), "heartbeats", "--port", ports_csv,
                 "--proplets", str(count), "--first", str(first), "--prefix", "hb",
                 "--interval-secs", "10", "--silent", "0", "--silence-after-secs", "7200",
                 "--run-after-silence-secs", "1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def running():
            try:
                return pick(metrics_of(ports[0]), "propeller_proplets", phase="Running")
            except OSError:
                return 0
        # All of them, or 30 s after 95% were (some of 30,000 can
        # fall Offline on this machine; the figure says how many).
        reached = None
        while running() < n:
            now_running = running()
            if now_running >= 0.95 * n:
                reached = reached or time.time()
                if time.time() - reached > 30:
                    break
            if time.time() - started > 900:
                raise SystemExit(f"{replicas} replica(s): {now_running} of {n} Running after 900 s")
            time.sleep(1)
        running_count = running()
        all_running = (reached or time.time()) - started
        time.sleep(10)
        steady = 40
        def received():
            return [pick(metrics_of(p), "propeller_broker_external_messages_received_total")
                    for p in ports]

        def reconciles():
            """Proplet and Task reconciles of the first replica so far."""
            m = metrics_of(ports[0])
            return {c: pick(m, "propeller_reconciles_total", controller=c) for c in ("proplet", "task")}
        reconciles0 = reconciles()
        cpu0 = [cpu_or_zero(p.pid) for p in procs], sum(cpu_or_zero(p) for p in broker_pids), \
            cpu_or_zero(apiserver_pid), api_requests(), time.time(), received()
        recorder = perf_record(procs[0].pid, "steady")
        time.sleep(steady)
        perf_done(recorder)
        cpu1 = [cpu_or_zero(p.pid) for p in procs], sum(cpu_or_zero(p) for p in broker_pids), \
            cpu_or_zero(apiserver_pid), api_requests(), time.time(), received()
        span = cpu1[4] - cpu0[4]
        reports = [b - a for a, b in zip(cpu0[5], cpu1[5])]
        reconciles1 = reconciles()
        result = {
            "replicas": replicas,
            "namespaces": K,
            "sharded_watches": SHARDED,
            "proplets": n,
            "created_s": round(created, 1),
            "replicas_ready_s": round(ready, 1),
            "running": running_count,
            "running_95pct_s": round(all_running, 1),
            "steady_replica_cpu_pct": [round((b - a) / span * 100, 1) for a, b in zip(cpu0[0], cpu1[0])],
            "steady_replica_rss_mib": [round(rss_mib(p.pid), 1) for p in procs],
            "steady_reports_per_replica": [round(r) for r in reports],
            "steady_reconciles_per_s": {c: round((reconciles1[c] - reconciles0[c]) / span, 1)
                                        for c in reconciles0},
            # A replica's whole CPU over the window divided by the reports it received in it:
            # what a report costs, everything else the replica does at rest included.
            "steady_cpu_us_per_report": [
                round((b - a) / r * 1e6, 1) if r else None
                for a, b, r in zip(cpu0[0], cpu1[0], reports)],
            "steady_brokers_cpu_pct": round((cpu1[1] - cpu0[1]) / span * 100, 1),
            "steady_brokers_rss_mib": round(sum(rss_mib(p) for p in broker_pids), 1),
            "steady_apiserver_cpu_pct": round((cpu1[2] - cpu0[2]) / span * 100, 1),
            "steady_status_writes_per_s": round((cpu1[3][1] - cpu0[3][1]) / span, 1),
            # The heartbeats ran through the window (each load generator still alive).
            "steady_loadgens_running": f"{sum(p.poll() is None for p in loadgens)} of {len(loadgens)}",
        }

        print(json.dumps(result))  # the steady state, even if the burst does not finish
        sys.stdout.flush()

        # 2. A 1,000-task burst on 4 real agents.
        workers = [f"w{i}" for i in range(AGENTS)]
        create_many([d for i, x in enumerate(workers) for d in objects(x, brokers, x, NAMESPACES[i % K])])
        wait_until("the agents rendered", lambda: rendered(workers), 120)
        # As for the fleet: at 30,000 users a node's reload took longer than the agents' wait.
        wait_until("every node accepting the agents' logins",
                   lambda: all(mqtt_accepts(int(p), x, f"{x}-secret") for p in ports_csv.split(",") for x in workers),
                   600)
        for i, x in enumerate(workers):
            order = ",".join(nodes[(i + k) % len(nodes)] for k in range(len(nodes)))
            env = dict(os.environ, PROPLET_MQTT_ADDRESS=order, PROPLET_DOMAIN_ID="d", PROPLET_CHANNEL_ID=x,
                       PROPLET_CLIENT_ID=x, PROPLET_CLIENT_KEY=f"{x}-secret",
                       PROPLET_STATE_DIR=os.path.join(work, x), RUST_LOG="warn")
            agents.append(subprocess.Popen([os.path.join(bin_dir, "proplet")], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until("the agents Running", lambda: running() >= running_count + AGENTS, 300)
        tasks_path = f"{GROUP}/tasks"

        def finished():
            items = admin.call("GET", tasks_path)["items"]
            return sum(1 for t in items if t.get("status", {}).get("phase") in ("completed", "failed"))
        reconciles0 = [pick(metrics_of(p), "propeller_reconciles_total", controller="task") for p in ports]
        before = [cpu_or_zero(p.pid) for p in procs], cpu_or_zero(apiserver_pid), api_requests()[0]
        kinds0 = requests_by_kind()
        recorder = perf_record(procs[0].pid, "burst")
        t0 = time.time()
        create_many([worker_task(f"burst-{i}", NAMESPACES[i % K]) for i in range(1000)])
        # Polled (a list every 0.5 s; not counted as requests): a watch open this long was
        # seen to end early.
        deadline = t0 + 900
        done = finished()
        while done < 1000 and time.time() < deadline:
            time.sleep(0.5)
            done = finished()
        span = time.time() - t0
        perf_done(recorder)
        after = [cpu_or_zero(p.pid) for p in procs], cpu_or_zero(apiserver_pid), api_requests()[0]
        kinds1 = requests_by_kind()
        reconciles1 = [pick(metrics_of(p), "propeller_reconciles_total", controller="task") for p in ports]
        time.sleep(6)  # the owned-objects gauges refresh every 5 s
        owned = [pick(metrics_of(p), "propeller_shard_owned", kind="Task") for p in ports]
        cached = [pick(metrics_of(p), "propeller_shard_cached", kind="Task") for p in ports]
        result |= {
            "burst_completed": done,
            "burst_tasks_per_s": round(done / span),
            "burst_replica_cpu_s": [round(b - a, 2) for a, b in zip(before[0], after[0])],
            "burst_apiserver_cpu_s": round(after[1] - before[1], 2),
            "burst_requests_per_task": round((after[2] - before[2]) / 1000, 2),
            "burst_task_reconciles": [round(b - a) for a, b in zip(reconciles0, reconciles1)],
            "tasks_owned": owned,
            "tasks_cached": cached,
            "burst_requests": {k: round(v - kinds0.get(k, 0)) for k, v in kinds1.items()
                               if v - kinds0.get(k, 0) >= 10},
            "reports_received_per_replica": [
                pick(metrics_of(p), "propeller_broker_external_messages_received_total") for p in ports],
        }
        print(json.dumps(result))
        sys.stdout.flush()
    finally:
        for p in agents + loadgens + procs:
            p.terminate()
        for p in agents + loadgens + procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.terminate()
        cluster.wait(timeout=60)


main()
