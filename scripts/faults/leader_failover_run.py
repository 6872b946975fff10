"""One run of scripts/faults/leader-failover.sh (see there for what it checks).

    leader_failover_run.py BIN_DIR DIR KILL_POINT TASKS RUN

DIR holds the control plane's admin.kubeconfig and propeller.kubeconfig.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_api import free_port, start_agent  # noqa: E402
from bench_kube import GROUP, Kube, proplet, secret  # noqa: E402

BIN, DIR, POINT, TASKS, RUN = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
AGENTS = 4
SETTLE = 180
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
TERMINAL = ("completed", "failed", "skipped", "interrupted")
ACCEPTED = re.compile(r'task accepted.*task_id="?([\w-]+)"?.*\brun=(\d+)')
NS = "default"
admin = os.path.join(DIR, "admin.kubeconfig")
kube = Kube(admin)


def inputs(n):
    return n, 3 * n + 7


def task(n):
    a, b = inputs(n)
    return {"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
            "metadata": {"name": f"t-{n}"},
            "spec": {"name": f"t-{n}", "functionName": "add", "file": ADD, "inputs": [a, b]}}


class Forwarder:
    """The Service in front of the replicas: each connection goes to the first replica whose
    MQTT port accepts it (only the leader listens), bytes copied both ways until either side
    closes."""

    def __init__(self, backends):
        self.backends = backends
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.listener.accept()
            upstream = None
            for port in self.backends():
                try:
                    upstream = socket.create_connection(("127.0.0.1", port), timeout=1)
                    upstream.settimeout(None)
                    break
                except OSError:
                    continue
            if upstream is None:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Replica:
    def __init__(self, name):
        self.name = name
        self.mqtt, self.metrics = free_port(), free_port()
        self.log = os.path.join(DIR, f"{name}.log")
        env = dict(os.environ, KUBECONFIG=os.path.join(DIR, "propeller.kubeconfig"), HOSTNAME=name,
                   RUST_LOG="warn,rumqttd=off")
        self.process = subprocess.Popen(
            [os.path.join(BIN, "propeller"), "run", "--leader-elect", "--lease-namespace", "propeller-system",
             "--mqtt-listen", f"127.0.0.1:{self.mqtt}", "--metrics-listen", f"127.0.0.1:{self.metrics}"],
            env=env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)

    def ready(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/readyz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False


def wait_for(what, check, limit, every=0.05):
    deadline = time.time() + limit
    while time.time() < deadline:
        if check():
            return time.time()
        time.sleep(every)
    raise SystemExit(f"run {RUN}: {what} not within {limit} s")


def tasks():
    items = kube.call("GET", f"{GROUP}/namespaces/{NS}/tasks")["items"]
    return [t for t in items if t["metadata"]["name"].startswith("t-")]


def finished():
    return sum(1 for t in tasks() if t.get("status", {}).get("phase") in TERMINAL)


def executions():
    runs = {}
    for i in range(AGENTS):
        with open(os.path.join(DIR, f"w{i}.log"), errors="replace") as f:
            for line in f:
                m = ACCEPTED.search(line)
                if m:
                    key = (m.group(1), int(m.group(2)))
                    runs[key] = runs.get(key, 0) + 1
    return runs


a = Replica("operator-a")
wait_for("operator-a leading", a.ready, 60)
b = Replica("operator-b")
replicas = [a, b]
forwarder = Forwarder(lambda: [r.mqtt for r in replicas if r.process.poll() is None])
names = [f"w{i}" for i in range(AGENTS)]
for x in names:
    kube.call("POST", f"/api/v1/namespaces/{NS}/secrets", secret(x, f"{x}-secret"))
    kube.call("POST", f"{GROUP}/namespaces/{NS}/proplets", proplet(x, forwarder.port))
agents = [start_agent(BIN, x, forwarder.port, os.path.join(DIR, x), log_path=os.path.join(DIR, f"{x}.log"))
          for x in names]
try:
    def all_running():
        items = kube.call("GET", f"{GROUP}/namespaces/{NS}/proplets")["items"]
        return sum(1 for p in items if p.get("status", {}).get("phase") == "Running") == AGENTS

    wait_for("the agents Running", all_running, 60)
    # 1,000 at once from 8 connections; the leader dies once POINT of them finished.
    local = threading.local()

    def post(n):
        if not hasattr(local, "kube"):
            local.kube = Kube(admin)
        local.kube.call("POST", f"{GROUP}/namespaces/{NS}/tasks", task(n))

    started = time.time()
    poster = threading.Thread(target=lambda: list(ThreadPoolExecutor(8).map(post, range(TASKS))))
    poster.start()
    threshold = int(POINT * TASKS)
    wait_for(f"{threshold} tasks finished", lambda: finished() >= threshold, 300, 0.2)
    done_at_kill = finished()
    a.process.send_signal(signal.SIGKILL)
    a.process.wait()
    killed = time.time()
    led = wait_for("operator-b leading", b.ready, 60)
    poster.join()
    try:
        settled = wait_for("every task terminal", lambda: finished() >= TASKS, SETTLE, 0.5) - killed
    except SystemExit:
        settled = None
    items = tasks()
    runs = executions()
    by_phase, wrong, reran = {}, 0, 0
    for t in items:
        st = t.get("status", {})
        phase = st.get("phase", "pending")
        by_phase[phase] = by_phase.get(phase, 0) + 1
        n = int(t["metadata"]["name"][2:])
        if phase == "completed" and st.get("results") != str(sum(inputs(n))):
            wrong += 1
        if (st.get("runCount") or 0) > 1:
            reran += 1
    completed = by_phase.get("completed", 0)
    lost = TASKS - completed + wrong
    doubled = sum(1 for v in runs.values() if v > 1) + reran
    executed = len({uid for uid, _ in runs})
    ok = lost == 0 and doubled == 0 and len(items) == TASKS
    took = f"{settled:.1f} s" if settled is not None else f"not within {SETTLE} s"
    print(f"run {RUN}: leader killed after {done_at_kill}/{TASKS} finished ({POINT:.0%} asked), "
          f"{killed - started:.1f} s into the burst; operator-b led {led - killed:.1f} s later; "
          f"all terminal {took} after the kill; completed {completed}, wrong sums {wrong}, "
          f"phases {by_phase}; executions {sum(runs.values())} over {executed} tasks; "
          f"lost {lost}, doubled {doubled}{'' if ok else '  <-- FAILED'}")
    sys.exit(0 if ok else 1)
finally:
    for p in agents + [r.process for r in replicas]:
        if p.poll() is None:
            p.terminate()
    for p in agents + [r.process for r in replicas]:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
