"""Measures N devices enrolling at once (`propeller-loadgen enrol`) against a running
propeller: the time from the first request to the last Proplet Running, propeller's CPU,
and in Kubernetes mode the API server's CPU and requests per enrolment.

  bench_enrol.py standalone N BIN_DIR PROPELLER_PID API_PORT DATA_DIR TLS_PORT CA TOKEN
  bench_enrol.py kubernetes N BIN_DIR PROPELLER_PID ADMIN_KUBECONFIG APISERVER_PID TLS_PORT CA TOKEN
"""

import json
import subprocess
import sys
import time

from bench_api import Api, cpu_seconds, pick
from bench_kube import Kube


def running_standalone(api):
    return pick(api.samples(), "propeller_proplets", phase="Running")


def running_kubernetes(kube):
    items = kube.call("GET", "/apis/propeller.propeller.absmach.eu/v1/namespaces/default/proplets")["items"]
    return sum(1 for p in items if (p.get("status") or {}).get("phase") == "Running")


def api_requests(kube):
    """Requests the API server served so far, by verb and resource (the bench's own reads
    are subtracted by the caller through their count)."""
    counts = {}
    for name, labels, value in kube.metrics():
        if name != "apiserver_request_total":
            continue
        key = f'{labels.get("verb")} {labels.get("resource")}{"/" + labels["subresource"] if labels.get("subresource") else ""}'
        counts[key] = counts.get(key, 0) + value
    return counts


def main():
    mode, n, bin_dir, propeller_pid = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    tls_port, ca, token = sys.argv[7], sys.argv[8], sys.argv[9]
    if mode == "standalone":
        api = Api(sys.argv[5], sys.argv[6])
        count = lambda: running_standalone(api)
        apiserver_pid, kube = None, None
    else:
        kube = Kube(sys.argv[5])
        apiserver_pid = int(sys.argv[6])
        count = lambda: running_kubernetes(kube)
    before_requests = api_requests(kube) if kube else {}
    cpu0 = cpu_seconds(propeller_pid)
    api_cpu0 = cpu_seconds(apiserver_pid) if apiserver_pid else 0
    started = time.monotonic()
    gen = subprocess.Popen([f"{bin_dir}/propeller-loadgen", "enrol", "--port", tls_port, "--ca", ca,
                            "--token", token, "--devices", str(n), "--hold-secs", "60"],
                           stdout=subprocess.PIPE, text=True)
    polls = 0
    all_running = None
    while time.monotonic() - started < 600:
        polls += 1
        if count() >= n:
            all_running = time.monotonic() - started
            break
        time.sleep(0.25)
    cpu1 = cpu_seconds(propeller_pid)
    api_cpu1 = cpu_seconds(apiserver_pid) if apiserver_pid else 0
    after_requests = api_requests(kube) if kube else {}
    enrolled = {}
    gen.terminate()
    for line in gen.stdout:
        e = json.loads(line)
        enrolled = e
    gen.wait()
    result = {
        "mode": mode,
        "devices": n,
        "all_running_s": round(all_running, 2) if all_running else None,
        "loadgen": enrolled,
        "propeller_cpu_s": round(cpu1 - cpu0, 2),
    }
    if kube:
        delta = {k: after_requests.get(k, 0) - before_requests.get(k, 0)
                 for k in after_requests if after_requests.get(k, 0) - before_requests.get(k, 0) > 0}
        # The bench's own polls: one LIST of proplets each, and the /metrics reads.
        delta["LIST proplets"] = delta.get("LIST proplets", 0) - polls
        result["apiserver_cpu_s"] = round(api_cpu1 - api_cpu0, 2)
        result["api_requests"] = {k: v for k, v in sorted(delta.items()) if v > 0}
        per = lambda key: round(delta.get(key, 0) / n, 3)
        result["per_device"] = {
            "creates (Secret + Proplet)": per("POST secrets") + per("POST proplets"),
            "Proplet status writes": per("PATCH proplets/status") + per("PUT proplets/status"),
            "Proplet patches (finalizer)": per("PATCH proplets"),
            "Events": per("POST events"),
            "token Secret updates (uses, per batch)": per("PUT secrets"),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
