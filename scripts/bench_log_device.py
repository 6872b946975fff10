"""The most one device's task log carries: a real agent runs a guest that prints flat out
(scripts/guests/printer.rs), with its log limits raised out of the way, on `propeller
standalone`. Run by `scripts/bench-logs.sh --one-device`, which starts propeller and passes
its ports and pid; see that script for what is measured."""
import atexit, base64, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, cpu_seconds, pick, proplet_manifest, start_agent
api_port, work, mqtt, bin_dir, pid, module, lines, runs = (
    sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6],
    int(sys.argv[7]), int(sys.argv[8]))
api = Api(api_port, os.path.join(work, "data"))
with open(module, "rb") as f:
    wasm = base64.b64encode(f.read()).decode()

api.raw("POST", "/v1/apply", proplet_manifest("printer", mqtt, "printer-secret"))
# The agent's own limits (100 lines a second, 1 MiB a run) are what a fleet runs with; here
# they are raised so that what is measured is the path: capture, spool, MQTT, propeller.
os.environ.update(PROPLET_LOG_LINES_PER_SECOND="100000000", PROPLET_LOG_RUN_BYTES="1Gi")
agent = start_agent(bin_dir, "printer", mqtt, os.path.join(work, "agent"), rust_log="warn",
                    log_path=os.path.join(work, "agent.log"))
atexit.register(agent.kill)
deadline = time.time() + 60
while api.call("GET", "/v1/objects/proplet/default/printer").get("status", {}).get("phase") != "Running":
    if time.time() > deadline:
        raise SystemExit("the agent's Proplet was not Running within 60 s")
    time.sleep(0.2)


def log_batches():
    return pick(api.samples(), "propeller_broker_messages_in_total", kind="logs")


rows = []
for run in range(runs):
    name = f"flood-{run}"
    batches0, cpu_p0, cpu_a0 = log_batches(), cpu_seconds(pid), cpu_seconds(agent.pid)
    t0 = time.time()
    api.raw("POST", "/v1/apply",
            f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
            f"spec:\n  name: {name}\n  functionName: print\n  file: {wasm}\n  inputs: [{lines}]\n"
            # A daemon: its output is only logged, not held as its result (1 MiB at most).
            f"  daemon: true\n"
            f"  propletSelector:\n    propletId: printer\n")
    last = f"line {lines}"
    deadline = t0 + 300
    while True:
        tail = api.raw("GET", f"/v1/logs/default/{name}?tailLines=1").decode().splitlines()
        if tail and json.loads(tail[-1])["text"] == last:
            break
        if time.time() > deadline:
            raise SystemExit(f"{name}: its last line never reached propeller")
        time.sleep(0.02)
    t_last = time.time()
    cpu_p, cpu_a, batches = cpu_seconds(pid) - cpu_p0, cpu_seconds(agent.pid) - cpu_a0, log_batches() - batches0
    task = api.call("GET", f"/v1/objects/task/default/{name}")
    kept = [json.loads(line) for line in api.raw("GET", f"/v1/logs/default/{name}").decode().splitlines()]
    printed = [k for k in kept if k["text"].startswith("line ")]
    dropped = [k["text"] for k in kept if k["stream"] == "agent"]
    missing = lines + 1 - len({k["text"] for k in printed})
    st = task.get("status", {})
    # Every line lost must be said in the log: an agent note counts the lines it dropped.
    noted = sum(int(d.split()[0]) for d in dropped if d.split()[0].isdigit())
    rows.append((name, st.get("phase"), t_last - t0, len(printed), missing, dropped, batches, cpu_a, cpu_p))
    print(f"{name}: {st.get('phase')}, last line at propeller {t_last - t0:.2f} s after the apply; "
          f"{len(printed)} lines kept, {missing} missing, agent notes {dropped}; {batches:.0f} batches; "
          f"CPU agent {cpu_a:.2f} s, propeller {cpu_p:.2f} s")
    if st.get("phase") != "completed" or missing != noted:
        raise SystemExit(f"{name}: {missing} lines lost, {noted} said lost, phase {st.get('phase')} ({st.get('error')})")

rows.sort(key=lambda r: r[2])
mid = rows[len(rows) // 2]
print()
print(f"| one device, a guest printing {lines + 1:,} lines flat out (median of {runs} runs) | |")
print("|---|---|")
print(f"| apply -> the last line held by propeller | {mid[2]:.2f} s (runs: {', '.join(f'{r[2]:.2f}' for r in sorted(rows))}) |")
print(f"| lines per second held by propeller, end to end | {mid[3] / mid[2]:,.0f} |")
print(f"| lines dropped by the agent, each said in the log | {mid[4]} (runs: {', '.join(str(r[4]) for r in sorted(rows))}) |")
print("| lines lost without a note | 0 (checked every run) |")
print(f"| MQTT batches (QoS 1) | {mid[6]:.0f}, {(lines + 1) / max(mid[6], 1):,.0f} lines each |")
print(f"| agent CPU | {mid[7]:.2f} s ({mid[7] / (lines + 1) * 1e6:.1f} us a line) |")
print(f"| propeller CPU (broker and operator) | {mid[8]:.2f} s ({mid[8] / (lines + 1) * 1e6:.1f} us a line) |")
