#!/usr/bin/env python3
"""The task pipeline through each device plane, side by side on one machine: the embedded
broker, a 3-node RabbitMQ cluster (propeller as its auth backend) and a 3-node NATS cluster
(rendered authorization). For each: `propeller standalone` (release) and 4 real agents, each
on its own channel and, on a cluster, each starting on a different node.

  1. single task create -> completed, 50 runs after 5 warm-ups (1 ms polling): median, p99;
  2. 1,000 tasks in one apply: tasks/s, propeller's CPU and the broker's CPU during it, and
     the resident memory of propeller and of the broker (all nodes) after it;
  3. with BENCH_HEARTBEATS=N (e.g. 10000): N simulated proplets (`propeller-loadgen
     heartbeats`, one connection each, spread over the nodes, a heartbeat every 10 s): time
     until all are Running, then a steady 40 s window: propeller's and the broker's CPU
     (% of one core) and resident memory.

Run by scripts/bench-external.sh, which builds the release binaries first:
  scripts/bench_external.py BIN_DIR [embedded,rabbitmq,nats]
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_api import Api, children_of, cpu_or_zero, free_port, pick, rss_mib  # noqa: E402

ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
AGENTS = 4


def task(name):
    return (f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
            f"spec:\n  name: {name}\n  functionName: add\n  file: {ADD}\n  inputs: [10, 32]\n")


def proplet(name, brokers):
    """An external Proplet on a channel of its own, with its key Secret."""
    return (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-secret\n"
            f"---\napiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\n"
            f"spec:\n  type: external\n  connectionConfig:\n    mqttAddress: \"{brokers}\"\n"
            f"    domainId: d\n    channelId: {name}\n    clientId: {name}\n"
            f"    clientKeySecretRef: {{name: {name}-key, key: key}}\n")


def heartbeat_phase(plane, api, bin_dir, propeller_pid, n):
    """Connects `n` simulated proplets and measures the steady state."""
    shared = ",".join(plane.nodes)
    for start in range(0, n, 500):
        docs = []
        for i in range(start, min(n, start + 500)):
            name = f"hb-{i}"
            docs.append(f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-key\n"
                        f"---\napiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\n"
                        f"spec:\n  type: external\n  connectionConfig:\n    mqttAddress: \"{shared}\"\n"
                        f"    domainId: d\n    channelId: c\n    clientId: {name}\n"
                        f"    clientKeySecretRef: {{name: {name}-key, key: key}}\n")
        api.call("POST", "/v1/apply", "---\n".join(docs))
    if plane.authorization:
        deadline = time.time() + 120
        while time.time() < deadline:
            with open(plane.authorization) as f:
                if f'"hb-{n - 1}"' in f.read():
                    break
            time.sleep(0.5)
        time.sleep(3)  # the reload propeller ran
    ports = ",".join(node.rsplit(":", 1)[1] for node in plane.nodes)
    steady = 40
    gen = subprocess.Popen([os.path.join(bin_dir, "propeller-loadgen"), "heartbeats", "--port", ports,
                            "--proplets", str(n), "--prefix", "hb", "--interval-secs", "10",
                            "--silent", "0", "--silence-after-secs", str(steady + 60),
                            "--run-after-silence-secs", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.time()
    try:
        deadline = started + 600
        while True:
            running = pick(api.samples(), "propeller_proplets", phase="Running")
            if running >= n + AGENTS:
                break
            if time.time() > deadline:
                raise SystemExit(f"{plane.mode}: only {running:.0f} of {n} proplets Running after 600 s")
            time.sleep(1)
        all_running = time.time() - started
        time.sleep(10)
        broker = plane.broker_pids()
        cpu0 = cpu_or_zero(propeller_pid), sum(cpu_or_zero(p) for p in broker), time.time()
        time.sleep(steady)
        cpu1 = cpu_or_zero(propeller_pid), sum(cpu_or_zero(p) for p in broker), time.time()
        span = cpu1[2] - cpu0[2]
        return {
            "heartbeat_proplets": n,
            "all_running_s": round(all_running, 1),
            "steady_propeller_cpu_pct": round((cpu1[0] - cpu0[0]) / span * 100, 1),
            "steady_broker_cpu_pct": round((cpu1[1] - cpu0[1]) / span * 100, 1) if broker else None,
            "steady_propeller_rss_mib": round(rss_mib(propeller_pid), 1),
            "steady_broker_rss_mib": round(sum(rss_mib(p) for p in broker), 1) if broker else None,
        }
    finally:
        gen.terminate()
        gen.wait(timeout=60)


class Plane:
    """A device plane: the brokers devices use and what propeller needs to use them."""

    def __init__(self, mode, work, bin_dir):
        self.mode, self.work, self.bin_dir = mode, work, bin_dir
        self.cluster = None
        self.password_file = os.path.join(work, "mqtt-password")
        with open(self.password_file, "w") as f:
            f.write("bench-propeller-password")
        self.args, self.nodes = [], []
        self.authorization = None
        if mode == "embedded":
            port = free_port()
            self.nodes = [f"mqtt://127.0.0.1:{port}"]
            self.args = ["--mqtt-listen", f"127.0.0.1:{port}"]
        elif mode == "rabbitmq":
            callback = free_port()
            secret = "bench-callback-secret-0123456789"
            secret_file = os.path.join(work, "callback-secret")
            with open(secret_file, "w") as f:
                f.write(secret)
            self._start_cluster(["rabbitmq", "--auth-base", f"http://127.0.0.1:{callback}/rabbitmq/{secret}"])
            self.args = ["--auth-callback-listen", f"127.0.0.1:{callback}",
                         "--auth-callback-secret-file", secret_file]
        elif mode == "nats":
            initial = os.path.join(work, "authorization.conf")
            with open(initial, "w") as f:
                f.write('authorization {\n  users: [\n    { user: "propeller", password: "bench-propeller-password" }\n  ]\n}\n')
            info = self._start_cluster(["nats", "--authorization", initial, "--user", "propeller",
                                        "--password", "bench-propeller-password"])
            self.authorization = info["authorization"]
            pids = " ".join(str(p) for p in info["pids"])
            self.args = ["--device-auth", "rendered", "--broker-config-file", self.authorization,
                         "--broker-config-reload", f"kill -HUP {pids}; true"]
        else:
            raise SystemExit(f"unknown mode {mode}")
        if mode != "embedded":
            self.args += ["--mqtt-broker", ",".join(self.nodes), "--mqtt-password-file", self.password_file]

    def _start_cluster(self, args):
        self.cluster = subprocess.Popen([os.path.join(self.bin_dir, "propeller-mqtt-cluster"), *args],
                                        stdout=subprocess.PIPE, text=True)
        line = self.cluster.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.mode} cluster did not start")
        info = json.loads(line)
        self.nodes = [f"mqtt://{a}" for a in info["mqtt"]]
        return info

    def broker_pids(self):
        return children_of(self.cluster.pid) if self.cluster else []

    def brokers_from(self, first):
        n = len(self.nodes)
        return ",".join(self.nodes[(first + i) % n] for i in range(n))

    def stop(self):
        if self.cluster:
            self.cluster.terminate()
            self.cluster.wait(timeout=60)


def run(mode, bin_dir):
    work = tempfile.mkdtemp(prefix=f"bench-external-{mode}-")
    plane, propeller, agents = None, None, []
    try:
        started = time.time()
        plane = Plane(mode, work, bin_dir)
        cluster_up = time.time() - started
        api_port = free_port()
        data = os.path.join(work, "data")
        log = open(os.path.join(work, "propeller.log"), "w")
        propeller = subprocess.Popen(
            [os.path.join(bin_dir, "propeller"), "standalone", "--data-dir", data,
             "--api-listen", f"127.0.0.1:{api_port}", *plane.args],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="warn"))
        for _ in range(100):
            if os.path.exists(os.path.join(data, "api-token")):
                break
            time.sleep(0.1)
        api = Api(api_port, data)
        names = [f"w{i}" for i in range(AGENTS)]
        api.call("POST", "/v1/apply", "---\n".join(proplet(n, ",".join(plane.nodes)) for n in names))
        if plane.authorization:
            deadline = time.time() + 30
            while time.time() < deadline:
                with open(plane.authorization) as f:
                    if all(f'"{n}"' in f.read() for n in names):
                        break
                time.sleep(0.1)
            time.sleep(1)  # the reload propeller ran
        for i, n in enumerate(names):
            env = dict(os.environ, PROPLET_MQTT_ADDRESS=plane.brokers_from(i), PROPLET_DOMAIN_ID="d",
                       PROPLET_CHANNEL_ID=n, PROPLET_CLIENT_ID=n, PROPLET_CLIENT_KEY=f"{n}-secret",
                       PROPLET_STATE_DIR=os.path.join(work, n), RUST_LOG="warn")
            agents.append(subprocess.Popen([os.path.join(bin_dir, "proplet")], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while time.time() < deadline:
            ps = api.call("GET", "/v1/objects/proplet?namespace=default")
            if sum(1 for p in ps if p.get("status", {}).get("phase") == "Running") == AGENTS:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"{mode}: the {AGENTS} agents did not come up")

        single = []
        for n in range(5 + 50):
            name = f"single-{n}"
            t0 = time.perf_counter()
            api.call("POST", "/v1/apply", task(name))
            while api.call("GET", f"/v1/objects/task/default/{name}").get("status", {}).get("phase") != "completed":
                time.sleep(0.001)
            if n >= 5:
                single.append((time.perf_counter() - t0) * 1000)
        single.sort()

        def finished():
            samples = api.samples()
            return sum(pick(samples, "propeller_tasks", phase=p) for p in ("completed", "failed"))

        before = finished()
        broker = plane.broker_pids()
        cpu0 = cpu_or_zero(propeller.pid), sum(cpu_or_zero(p) for p in broker)
        t0 = time.time()
        api.call("POST", "/v1/apply", "---\n".join(task(f"burst-{n}") for n in range(1000)))
        deadline = t0 + 300
        while finished() < before + 1000:
            if time.time() > deadline:
                raise SystemExit(f"{mode}: the burst did not finish in 300 s")
            time.sleep(0.05)
        span = time.time() - t0
        cpu1 = cpu_or_zero(propeller.pid), sum(cpu_or_zero(p) for p in broker)
        broker_rss = sum(rss_mib(p) for p in broker) if broker else 0.0
        heartbeats = {}
        n = int(os.environ.get("BENCH_HEARTBEATS", "0"))
        if n:
            heartbeats = heartbeat_phase(plane, api, bin_dir, propeller.pid, n)
        return heartbeats | {
            "mode": mode,
            "cluster_up_s": round(cluster_up, 1),
            "single_median_ms": round(statistics.median(single), 1),
            "single_p99_ms": round(single[int(0.99 * (len(single) - 1))], 1),
            "burst_tasks_per_s": round(1000 / span),
            "burst_propeller_cpu_s": round(cpu1[0] - cpu0[0], 2),
            "burst_broker_cpu_s": round(cpu1[1] - cpu0[1], 2) if broker else None,
            "propeller_rss_mib": round(rss_mib(propeller.pid), 1),
            "broker_rss_mib": round(broker_rss, 1) if broker else None,
        }
    finally:
        for a in agents:
            a.terminate()
        if propeller:
            propeller.terminate()
            propeller.wait(timeout=30)
        if plane:
            plane.stop()
        shutil.rmtree(work, ignore_errors=True)


def main():
    bin_dir = sys.argv[1]
    modes = (sys.argv[2] if len(sys.argv) > 2 else "embedded,rabbitmq,nats").split(",")
    for mode in modes:
        result = run(mode, bin_dir)
        print(json.dumps(result))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
