"""The agent benchmark: start-up, idle memory and task latencies of one real proplet.

Run by `scripts/bench-agent.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import json, os, re, statistics, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, proplet_manifest
api, mqtt, work, agent, hello, greet = sys.argv[1:7]
call = Api(api, os.path.join(work, "sa")).call
call("POST", "/v1/apply", proplet_manifest("pi", mqtt, "pi-secret"))
log = open(os.path.join(work, "agent-debug.log"), "w")
env = dict(os.environ, PROPLET_MQTT_ADDRESS=f"tcp://127.0.0.1:{mqtt}", PROPLET_DOMAIN_ID="d", PROPLET_CHANNEL_ID="c",
           PROPLET_CLIENT_ID="pi", PROPLET_CLIENT_KEY="pi-secret", PROPLET_STATE_DIR=os.path.join(work, "pi"),
           RUST_LOG="warn,proplet_agent=debug", NO_COLOR="1")
proc = subprocess.Popen([agent], env=env, stdout=log, stderr=subprocess.STDOUT)
try:
    for _ in range(300):
        if call("GET", "/v1/objects/proplet/default/pi").get("status", {}).get("phase") == "Running":
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the agent did not come up")
    ADD = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags="
    def run(name, function, file, inputs):
        call("POST", "/v1/apply", f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
             f"spec:\n  name: {name}\n  functionName: {function}\n  file: {file}\n  inputs: {inputs}\n")
        while True:
            t = call("GET", f"/v1/objects/task/default/{name}")
            if t.get("status", {}).get("phase") in ("completed", "failed"):
                if t["status"]["phase"] != "completed":
                    raise SystemExit(f"{name}: {t['status']}")
                return t["metadata"]["uid"]
            time.sleep(0.005)
    uids = {"add": [], "hello": [], "greet": []}
    for i in range(51):
        uids["add"].append(run(f"add-{i}", "add", ADD, "[10, 32]"))
    for i in range(51):
        uids["hello"].append(run(f"hello-{i}", "_start", hello, "[]"))
    for i in range(51):
        uids["greet"].append(run(f"greet-{i}", "greet", greet, json.dumps(['"John Doe"'])))
    time.sleep(0.5)
finally:
    proc.terminate()
    proc.wait()
    log.close()
took = {}
for line in open(os.path.join(work, "agent-debug.log")):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    m = re.search(r'result published task_id="?([^" ]+)"? turnaround_us=(\d+)', line)
    if m:
        took[m.group(1)] = int(m.group(2))
labels = {"add": "add(10, 32)", "hello": "WASI hello", "greet": "component greet (custom export, WAVE)"}
for what in ("add", "hello", "greet"):
    times = [took.get(u) for u in uids[what]]
    if any(t is None for t in times):
        raise SystemExit(f"missing turnaround lines for {what}")
    warm = sorted(times[1:])
    label = labels[what]
    print(f"{label}: cold (first, compiles) {times[0]} us; warm median {statistics.median(warm):.0f} us, "
          f"p99 {warm[int(0.99 * (len(warm) - 1))]} us (50 runs)")
