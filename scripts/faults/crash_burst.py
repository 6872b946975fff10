"""The crash-burst fault case: propeller killed mid-burst, nothing lost or run twice.

Run by `scripts/faults/crash-burst.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import os, random, re, signal, subprocess, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_api import Api, free_port, pick, proplet_manifest, start_agent

BIN, WORK = sys.argv[1:3]
RUNS = int(os.environ.get("CRASH_RUNS", "10"))
TASKS = int(os.environ.get("CRASH_TASKS", "1000"))
AGENTS = 4
SETTLE = 120
ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
TERMINAL = ("completed", "failed", "skipped", "interrupted")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ACCEPTED = re.compile(r'task accepted.*task_id="?([\w-]+)"?.*\brun=(\d+)')
REPEATED = re.compile(r'published again.*task_id="?([\w-]+)"?')


def inputs(n):
    return n, 3 * n + 7


def task(n, extra=""):
    a, b = inputs(n)
    return (f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: t-{n}\n"
            f"spec:\n  name: t-{n}\n  functionName: add\n  file: {ADD}\n  inputs: [{a}, {b}]\n{extra}")


class Cluster:
    """One standalone propeller and its agents, logs in files under `root`."""

    def __init__(self, root):
        self.root = root
        self.data = os.path.join(root, "data")
        os.makedirs(root)
        self.mqtt, self.api_port = free_port(), free_port()
        self.propeller = None
        self.agents = {}

    def start_propeller(self):
        log = open(os.path.join(self.root, "propeller.log"), "a")
        self.propeller = subprocess.Popen(
            [os.path.join(BIN, "propeller"), "standalone", "--data-dir", self.data,
             "--mqtt-listen", f"127.0.0.1:{self.mqtt}", "--api-listen", f"127.0.0.1:{self.api_port}"],
            env=dict(os.environ, RUST_LOG="warn"), stdout=log, stderr=log)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if os.path.exists(os.path.join(self.data, "api-token")):
                    self.api = Api(self.api_port, self.data, timeout=10)
                    self.api.samples()
                    return
            except SystemExit:
                pass
            time.sleep(0.02)
        raise SystemExit("propeller did not answer within 30 s")

    def kill_propeller(self):
        self.propeller.send_signal(signal.SIGKILL)
        self.propeller.wait()

    def start_agent(self, i):
        name = f"w{i}"
        self.agents[name] = start_agent(BIN, name, self.mqtt, os.path.join(self.root, name),
                                        log_path=os.path.join(self.root, f"{name}.log"))

    def up(self):
        self.start_propeller()
        self.api.call("POST", "/v1/apply", "---\n".join(
            proplet_manifest(f"w{i}", self.mqtt, f"w{i}-secret") for i in range(AGENTS)))
        for i in range(AGENTS):
            self.start_agent(i)
        deadline = time.time() + 30
        while time.time() < deadline:
            ps = self.api.call("GET", "/v1/objects/proplet?namespace=default")
            if sum(1 for p in ps if p.get("status", {}).get("phase") == "Running") == AGENTS:
                return
            time.sleep(0.1)
        raise SystemExit("the agents did not come up")

    def phase_counts(self):
        samples = self.api.samples()
        return {p: pick(samples, "propeller_tasks", phase=p)
                for p in ("pending", "scheduled", "running") + TERMINAL}

    def finished(self):
        c = self.phase_counts()
        return sum(c[p] for p in TERMINAL)

    def wait_terminal(self, limit):
        """Seconds until every task is terminal, or None after `limit`."""
        started = time.time()
        while time.time() - started < limit:
            try:
                if self.finished() >= TASKS:
                    return time.time() - started
            except SystemExit:
                pass
            time.sleep(0.05)
        return None

    def executions(self):
        """(task uid, run) -> executions, and results sent again, from the agents' logs."""
        runs, repeated = {}, 0
        for i in range(AGENTS):
            path = os.path.join(self.root, f"w{i}.log")
            if not os.path.exists(path):
                continue
            with open(path, errors="replace") as f:
                for line in f:
                    line = ANSI.sub("", line)
                    m = ACCEPTED.search(line)
                    if m:
                        key = (m.group(1), int(m.group(2)))
                        runs[key] = runs.get(key, 0) + 1
                    elif REPEATED.search(line):
                        repeated += 1
        return runs, repeated

    def down(self):
        for p in list(self.agents.values()) + [self.propeller]:
            if p and p.poll() is None:
                p.terminate()
        for p in list(self.agents.values()) + [self.propeller]:
            if p:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def apply_burst(c, extra=""):
    c.api.call("POST", "/v1/apply", "---\n".join(task(n, extra) for n in range(TASKS)))


def kill_when(c, threshold, deadline_s=60):
    """Waits until `threshold` tasks finished (0: at once); returns how many had."""
    deadline = time.time() + deadline_s
    done = c.finished()
    while done < threshold and time.time() < deadline:
        time.sleep(0.005)
        done = c.finished()
    return done


def count(c):
    tasks = [t for t in c.api.call("GET", "/v1/objects/task?namespace=default")
             if t["metadata"]["name"].startswith("t-")]
    runs, repeated = c.executions()
    by_phase, wrong, run_counts = {}, 0, {}
    for t in tasks:
        st = t.get("status", {})
        phase = st.get("phase", "pending")
        by_phase[phase] = by_phase.get(phase, 0) + 1
        n = int(t["metadata"]["name"][2:])
        if phase == "completed" and st.get("results") != str(sum(inputs(n))):
            wrong += 1
        run_counts[t["metadata"]["uid"]] = st.get("runCount") or 0
    doubled_pairs = sum(1 for v in runs.values() if v > 1)
    rerun_tasks = sum(1 for v in run_counts.values() if v > 1)
    executed_tasks = len({uid for uid, _ in runs})
    return dict(tasks=len(tasks), completed=by_phase.get("completed", 0), failed=by_phase.get("failed", 0),
                nonterminal=sum(v for k, v in by_phase.items() if k not in TERMINAL), wrong=wrong,
                executions=sum(runs.values()), executed_tasks=executed_tasks,
                doubled=doubled_pairs + rerun_tasks, repeated=repeated, by_phase=by_phase)


failures = []
seed = int(os.environ.get("CRASH_SEED", str(int(time.time()))))
rng = random.Random(seed)
print(f"variant 1: propeller killed mid-burst, {RUNS} runs, {TASKS} tasks, {AGENTS} agents (seed {seed})")
points = [0.0] + [round(0.05 + 0.9 * i / max(RUNS - 2, 1), 2) for i in range(RUNS - 1)]
for run, point in enumerate(points[:RUNS]):
    fraction = 0.0 if point == 0.0 else min(0.97, max(0.01, point + rng.uniform(-0.03, 0.03)))
    c = Cluster(os.path.join(WORK, f"crash-{run}"))
    try:
        c.up()
        apply_burst(c)
        at = kill_when(c, int(fraction * TASKS))
        c.kill_propeller()
        restarted = time.time()
        c.start_propeller()
        recovered = c.wait_terminal(SETTLE)
        r = count(c)
        lost = TASKS - r["completed"] - r["nonterminal"] + r["wrong"]
        stuck = r["nonterminal"]
        ok = lost == 0 and r["doubled"] == 0 and stuck == 0 and r["completed"] == TASKS
        took = f"{recovered:.2f} s" if recovered is not None else f"> {SETTLE} s"
        print(f"run {run + 1}: killed after {at:.0f}/{TASKS} finished ({fraction:.0%} asked); "
              f"completed {r['completed']}, failed {r['failed']}, non-terminal {stuck}, wrong sums {r['wrong']}; "
              f"executions {r['executions']} over {r['executed_tasks']} tasks, results sent again {r['repeated']}; "
              f"lost {lost}, doubled {r['doubled']}, stuck {stuck}; recovered {took} after the restart"
              f"{'' if ok else '  <-- FAILED ' + str(r['by_phase'])}")
        if not ok:
            failures.append(f"crash run {run + 1}")
    finally:
        c.down()

print("variant 2: one agent killed mid-burst and left dead; tasks have timeoutSeconds: 20")
c = Cluster(os.path.join(WORK, "agent-kill"))
try:
    c.up()
    apply_burst(c, "  timeoutSeconds: 20\n")
    at = kill_when(c, int(0.3 * TASKS))
    c.agents["w0"].send_signal(signal.SIGKILL)
    c.agents["w0"].wait()
    killed = time.time()
    settled = c.wait_terminal(SETTLE)
    r = count(c)
    tasks = c.api.call("GET", "/v1/objects/task?namespace=default")
    failed_on = {}
    for t in tasks:
        st = t.get("status", {})
        if st.get("phase") == "failed":
            key = (st.get("assignedProplet"), (st.get("error") or "")[:40])
            failed_on[key] = failed_on.get(key, 0) + 1
    only_dead = all(p == "w0" for p, _ in failed_on)
    ok = (r["nonterminal"] == 0 and r["doubled"] == 0 and r["wrong"] == 0 and only_dead
          and r["completed"] + r["failed"] == TASKS)
    took = f"{settled:.2f} s" if settled is not None else f"> {SETTLE} s"
    print(f"agent w0 killed after {at:.0f}/{TASKS} finished: completed {r['completed']}, failed {r['failed']} "
          f"({', '.join(f'{n} on {p}: {e}' for (p, e), n in failed_on.items()) or 'none'}), "
          f"non-terminal {r['nonterminal']}, wrong sums {r['wrong']}, executions {r['executions']}, "
          f"doubled {r['doubled']}; all terminal {took} after the kill"
          f"{'' if ok else '  <-- FAILED ' + str(r['by_phase'])}")
    if not ok:
        failures.append("agent kill")
finally:
    c.down()

if failures:
    raise SystemExit(f"crash-burst failed: {', '.join(failures)}")
print("crash-burst: every task ended terminal, none lost, none run twice")
