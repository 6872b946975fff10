"""The OCI benchmark: Wasm from a registry in chunks over MQTT against plain HTTP.

Run by `scripts/bench-oci.sh`, which starts the processes and passes their ports and pids;
see that script for what is measured."""
import os, statistics, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import Api, pick, proplet_manifest
api_port, work, mqtt, bin_dir, reg, web = sys.argv[1:7]
AGENTS = int(os.environ.get("OCI_AGENTS", "10"))
SIZES = [int(x) for x in os.environ.get("OCI_SIZES", "1000000,10000000").split(",")]
PACES = os.environ.get("OCI_PACES", "16MiB,0").split(",")
api = call = None

def start(pace, data):
    """propeller standalone publishing chunks at `pace`, and the agents."""
    global api, call
    server = subprocess.Popen([os.path.join(bin_dir, "propeller"), "standalone", "--data-dir", data,
                               "--mqtt-listen", f"127.0.0.1:{mqtt}", "--api-listen", f"127.0.0.1:{api_port}",
                               "--registry-plain-http", f"127.0.0.1:{reg}", "--image-chunk-rate", pace],
                              env=dict(os.environ, RUST_LOG="warn"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if os.path.exists(os.path.join(data, "api-token")):
            break
        time.sleep(0.1)
    time.sleep(0.3)
    api = Api(api_port, data)
    call = api.call
    call("POST", "/v1/apply", "---\n".join(proplet_manifest(f"w{i}", mqtt, f"w{i}-secret") for i in range(AGENTS)))
    agents = []
    for i in range(AGENTS):
        env = dict(os.environ, PROPLET_MQTT_ADDRESS=f"tcp://127.0.0.1:{mqtt}", PROPLET_DOMAIN_ID="d",
                   PROPLET_CHANNEL_ID="c", PROPLET_CLIENT_ID=f"w{i}", PROPLET_CLIENT_KEY=f"w{i}-secret",
                   PROPLET_STATE_DIR=os.path.join(data, f"w{i}"), PROPLET_LIVELINESS_INTERVAL="1",
                   RUST_LOG="warn")
        agents.append(subprocess.Popen([os.path.join(bin_dir, "proplet")], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.time() + 60
    while time.time() < deadline:
        ps = call("GET", "/v1/objects/proplet?namespace=default")
        if sum(1 for p in ps if p.get("status", {}).get("phase") == "Running") == AGENTS:
            return [server] + agents
        time.sleep(0.1)
    raise SystemExit("the agents did not come up")

def counters():
    samples = api.samples()
    return (pick(samples, "propeller_image_registry_pulls_total"), pick(samples, "propeller_image_transfers_total"))

pushed = 0
def push(size):
    """A new image (bytes no earlier push had) of `size`: its OCI reference and http:// URL."""
    global pushed
    pushed += 1
    name = f"m{pushed}"
    subprocess.run([os.path.join(bin_dir, "propeller-loadgen"), "push-module", "--registry", f"127.0.0.1:{reg}",
                    "--reference", f"bench/{name}:v1", "--size", str(size), "--fill", str(pushed % 256),
                    "--out", os.path.join(work, "www", f"{name}.wasm")], check=True, capture_output=True, text=True)
    return f"127.0.0.1:{reg}/bench/{name}:v1", f"http://127.0.0.1:{web}/{name}.wasm"

runs = 0
def run(image, agents_wanted):
    global runs
    runs += 1
    name = f"t{runs}"
    spread = "  broadcast: true\n" if agents_wanted > 1 else "  propletSelector:\n    propletId: w0\n"
    manifest = (f"apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n"
                f"spec:\n  name: {name}\n  functionName: add\n  imageUrl: {image}\n  inputs: [1, 2]\n{spread}")
    t0 = time.perf_counter()
    call("POST", "/v1/apply", manifest)
    deadline = time.time() + 120
    while time.time() < deadline:
        status = call("GET", f"/v1/objects/task/default/{name}").get("status", {})
        if status.get("phase") in ("completed", "failed"):
            break
        time.sleep(0.001)
    else:
        raise SystemExit(f"{name} did not finish")
    elapsed = (time.perf_counter() - t0) * 1000
    if status["phase"] != "completed":
        raise SystemExit(f"{name} failed: {status.get('error')}")
    if agents_wanted > 1 and len(status.get("results", {})) != agents_wanted:
        raise SystemExit(f"{name}: {len(status.get('results', {}))} results, expected {agents_wanted}")
    return elapsed

def heartbeat_gap():
    """The longest gap between consecutive heartbeats propeller recorded (the last ten of each
    agent, which beat every second): transfers that starved the broker would stretch it."""
    from datetime import datetime
    gaps = []
    for p in call("GET", "/v1/objects/proplet?namespace=default"):
        beats = sorted(datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
                       for t in p.get("status", {}).get("aliveHistory", []))
        gaps += [b - a for a, b in zip(beats, beats[1:])]
    return max(gaps, default=0.0)

def fmt(samples):
    return f"median {statistics.median(samples):7.0f} ms (min {min(samples):.0f}, max {max(samples):.0f})"

for pace in PACES:
    procs = start(pace, os.path.join(work, f"data-{pace}"))
    try:
        warm, _ = push(1000)
        run(warm, 1)
        run(warm, AGENTS)
        label_pace = f"pace {pace}/s" if pace != "0" else "unpaced (--image-chunk-rate 0)"
        print(f"chunks at {label_pace}")
        print(f"{'module':>7} {'agents':>6}  {'case':<7} apply -> completed (3 runs)")
        for size in SIZES:
            for n in (1, AGENTS):
                pulls0, sent0 = counters()
                cold, cached, http = [], [], []
                for _ in range(3):
                    image, _ = push(size)
                    cold.append(run(image, n))
                    cached.append(run(image, n))
                    if pace != "0":
                        _, url = push(size)
                        http.append(run(url, n))
                pulls, sent = (a - b for a, b in zip(counters(), (pulls0, sent0)))
                label = f"{size // 1_000_000:>5} MB {n:>6}"
                print(f"{label}  cold    {fmt(cold)}")
                print(f"{label}  cached  {fmt(cached)}")
                if http:
                    print(f"{label}  http    {fmt(http)}")
                print(f"{'':>15}  registry pulls {pulls:.0f} for 3 images; chunk transfers {sent:.0f} for 6 runs; "
                      f"longest heartbeat gap in the last 10 s {heartbeat_gap():.2f} s (interval 1 s)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
