"""The standalone API as the benchmark scripts use it: bearer-token calls, `/metrics` read with
prometheus_client's parser, process figures from psutil, and the manifest of one external
Proplet with its key Secret. Imported by the benchmark and fault programs under `scripts/`
(run with Debian's python3 and its python3-psutil and python3-prometheus-client packages,
which `scripts/lib/harness.sh` installs)."""
import http.client
import json
import os
import signal
import subprocess
import threading
import time

import psutil
from prometheus_client.parser import text_string_to_metric_families


class Api:
    """Calls `propeller standalone`'s HTTP API on 127.0.0.1:`port` with the token it wrote
    into `data_dir`."""

    def __init__(self, port, data_dir, timeout=120):
        self.port = int(port)
        self.timeout = timeout
        # One kept-alive connection, so polling measures the API and not TCP set-up. Use an
        # Api from one thread at a time.
        self.conn = None
        with open(os.path.join(data_dir, "api-token")) as f:
            self.token = f.read().strip()

    def raw(self, method, path, body=None):
        """The response body as bytes; a non-2xx answer ends the script with its message."""
        return kept_alive_request(
            self, lambda: http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout),
            method, path, body, {"Authorization": f"Bearer {self.token}"}, range(200, 300))

    def call(self, method, path, body=None):
        """The response body as JSON."""
        return json.loads(self.raw(method, path, body))

    def samples(self):
        """`(name, labels text, value)` for every sample in `/metrics`: one small request,
        which polls more cheaply than listing objects."""
        return parse_metrics(self.raw("GET", "/metrics").decode())


def parse_metrics(text):
    """`(name, labels, value)` of every sample of a Prometheus text exposition."""
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples]


def fleet_metrics(api):
    """The figures the fleet scripts follow, from one `/metrics` read: proplets Running and
    Offline, Proplet status writes, durable commits and store transactions."""
    samples = api.samples()
    return {
        "running": pick(samples, "propeller_proplets", phase="Running"),
        "offline": pick(samples, "propeller_proplets", phase="Offline"),
        "proplet_writes": pick(samples, "propeller_store_changes_total", kind="Proplet",
                               change="Modified"),
        "durable": pick(samples, "propeller_store_durable_commits_total"),
        "transactions": pick(samples, "propeller_store_transactions_total"),
        # PUBLISH packets devices sent the embedded broker, every topic kind.
        "reports": pick(samples, "propeller_broker_messages_in_total"),
    }


def store_fleet(api, mqtt_port, n):
    """Applies `n` Proplets `hb-<i>` with their Secrets (in chunks under the API's body
    limit) and waits until the reconcilers settle (finalizers on, credentials built)."""
    for start in range(0, n, 500):
        docs = [proplet_manifest(f"hb-{i}", mqtt_port, f"hb-{i}-key")
                for i in range(start, min(n, start + 500))]
        api.raw("POST", "/v1/apply", "---\n".join(docs))
    last = -1
    while True:
        now = fleet_metrics(api)["transactions"]
        if now == last:
            return
        last = now
        time.sleep(2)


class Sampler:
    """Samples (time, CPU seconds, RSS MiB, `figures()`) of process `pid` every `every` s in a
    thread of its own, until `stop()`; the samples are in `samples`."""

    def __init__(self, pid, figures, every):
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, figures, every), daemon=True)
        self._thread.start()

    def _run(self, pid, figures, every):
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), cpu_seconds(pid), rss_mib(pid), figures()))
            except Exception as e:  # the run ends; keep what we have
                print(f"sampling stopped: {e}")
                return
            self._stop.wait(every)

    def stop(self):
        self._stop.set()
        self._thread.join()


def loadgen(bin_dir, args):
    """Runs `propeller-loadgen` with `args`, printing its events; returns them by name."""
    gen = subprocess.Popen([os.path.join(bin_dir, "propeller-loadgen"), *args],
                           stdout=subprocess.PIPE, text=True)
    events = {}
    for line in gen.stdout:
        e = json.loads(line)
        events[e["event"]] = e
        print(f"loadgen: {line.strip()}")
    gen.wait()
    return events


def heartbeat_load(bin_dir, mqtt_port, n, silent, threshold, silence_after=70):
    """Runs `propeller-loadgen heartbeats`: `n` proplets `hb-<i>` beating every 10 s, the
    first `silent` of them silent from `silence_after` s after the last connection until
    everything disconnects `threshold + 20` s later. Prints its events; returns them by name."""
    return loadgen(bin_dir, ["heartbeats", "--port", str(mqtt_port), "--proplets", str(n),
                             "--prefix", "hb", "--interval-secs", "10", "--silent", str(silent),
                             "--silence-after-secs", str(silence_after),
                             "--run-after-silence-secs", str(threshold + 20)])


def kept_alive_request(owner, connect, method, path, body, headers, ok):
    """One request on `owner.conn` (made with `connect` when missing), retried on a fresh
    connection when the kept-alive one was closed; the body as bytes. A status outside `ok`
    ends the script with its message."""
    for _ in range(3):
        if owner.conn is None:
            owner.conn = connect()
        try:
            owner.conn.request(method, path, body=body, headers=headers)
            r = owner.conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException):
            owner.conn.close()
            owner.conn = None
            continue
        if r.status not in ok:
            raise SystemExit(f"{method} {path}: {r.status} {data[:300]!r}")
        return data
    raise SystemExit(f"{method} {path}: no answer")


def pick(samples, name, **labels):
    """The sum of metric `name` over the `samples` carrying every given label value."""
    return sum(value for n, lbl, value in samples
               if n == name and all(lbl.get(k) == str(v) for k, v in labels.items()))


def cpu_seconds(pid):
    """User + system CPU time process `pid` has used so far."""
    times = psutil.Process(int(pid)).cpu_times()
    return times.user + times.system


def cpu_or_zero(pid):
    """cpu_seconds of `pid`, 0 when there is no such process (any more)."""
    try:
        return cpu_seconds(pid) if pid else 0
    except psutil.Error:
        return 0


def parent_of(pid):
    """The parent pid of process `pid`."""
    return psutil.Process(int(pid)).ppid()


def children_of(pid):
    """Every descendant of process `pid`."""
    return [child.pid for child in psutil.Process(int(pid)).children(recursive=True)]


def machine_cpu_seconds():
    """(busy, total) CPU seconds of the whole machine so far, over all cores."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(times)
    # guest time is already counted in user time.
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    return total - idle, total


def pid_named(comm, parent=None):
    """The pid of a process whose name is `comm` (Linux cuts names at 15 characters),
    a child of `parent` when given; None when there is none."""
    for proc in psutil.process_iter(["name", "ppid"]):
        if proc.info["name"] == comm[:15] and (parent is None or proc.info["ppid"] == parent):
            return proc.pid
    return None


def rss_mib(pid):
    """Resident memory of process `pid`, in MiB."""
    return psutil.Process(int(pid)).memory_info().rss / (1024 * 1024)


def open_files(pid):
    """How many descriptors process `pid` holds."""
    return psutil.Process(int(pid)).num_fds()


def proplet_manifest(name, mqtt_port, key):
    """An external Proplet `name` on channel d/c whose device logs in as `name` with `key`."""
    return (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {key}\n"
            f"---\napiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\n"
            f"spec:\n  type: external\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:{mqtt_port}\n"
            f"    domainId: d\n    channelId: c\n    clientId: {name}\n"
            f"    clientKeySecretRef: {{name: {name}-key, key: key}}\n")


def free_port():
    """A TCP port on 127.0.0.1 that is free now, from below the kernel's ephemeral range.

    A port the kernel hands out for bind(0) can be taken by any outgoing connection before
    (or, for a server that restarts, between) the binds of the server it is meant for; ports
    below the range are only ever taken by an explicit bind.
    """
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    floor = 10000
    for _ in range(1000):
        port = random.randrange(floor, max(low, floor + 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(bin_dir, name, mqtt_port, state_dir, rust_log="info", log_path=None):
    """A real `proplet` on channel d/c logging in as `name` with key `<name>-secret`; its
    output goes to `log_path` (appended), or nowhere."""
    env = dict(os.environ, PROPLET_MQTT_ADDRESS=f"tcp://127.0.0.1:{mqtt_port}", PROPLET_DOMAIN_ID="d",
               PROPLET_CHANNEL_ID="c", PROPLET_CLIENT_ID=name, PROPLET_CLIENT_KEY=f"{name}-secret",
               PROPLET_STATE_DIR=state_dir, RUST_LOG=rust_log)
    out = open(log_path, "a") if log_path else subprocess.DEVNULL
    return subprocess.Popen([os.path.join(bin_dir, "proplet")], env=env, stdout=out,
                            stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)


def perf_record(pid, name):
    """Samples `pid` into $BENCH_PERF/NAME.data until perf_done; None without BENCH_PERF."""
    out = os.environ.get("BENCH_PERF")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    graph = ["--call-graph", os.environ["BENCH_PERF_CALLGRAPH"]] if os.environ.get("BENCH_PERF_CALLGRAPH") else []
    return subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "499", "-p", str(pid), *graph,
                             "-o", os.path.join(out, f"{name}.data")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_done(recorder):
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=120)
