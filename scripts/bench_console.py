"""The console benchmark: propeller's cost with and without one browser on the Fleet page.

Run by `scripts/bench-console.sh`, which starts propeller and passes its ports and pid; see that
script for what is measured. The browser is driven over the W3C WebDriver protocol (plain JSON
over HTTP to Debian's chromedriver)."""
import json, os, statistics, subprocess, sys, time, urllib.request
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_api import (Api, cpu_or_zero, cpu_seconds, fleet_metrics, free_port, rss_mib, store_fleet,
                       children_of)
api_port, work, mqtt, bin_dir, n, pid, window = (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4],
                                                 int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
api = Api(api_port, os.path.join(work, "data"))
console_bytes = sum(len(urllib.request.urlopen(f"http://127.0.0.1:{api_port}/console/{f}").read())
                    for f in ["", "console.js", "api.js", "render.js", "views.js", "console.css"])

t = time.time()
store_fleet(api, mqtt, n)
print(f"{n} Proplets stored in {time.time() - t:.1f} s")
# Heartbeats for the whole run: nobody goes silent.
run_for = 60 + 4 * window + 60
load = subprocess.Popen([os.path.join(bin_dir, "propeller-loadgen"), "heartbeats", "--port", str(mqtt),
                         "--proplets", str(n), "--prefix", "hb", "--interval-secs", "10", "--silent", "0",
                         "--silence-after-secs", str(run_for), "--run-after-silence-secs", "1"],
                        stdout=subprocess.DEVNULL)
deadline = time.time() + 300
while fleet_metrics(api)["running"] < n:
    if time.time() > deadline:
        raise SystemExit("the proplets never all ran")
    time.sleep(1)
print(f"all {n} Running; waiting 15 s to settle")
time.sleep(15)


class WebDriver:
    """A headless Chromium session through chromedriver on a free port."""
    def __init__(self):
        self.port = free_port()
        self.driver = subprocess.Popen(["/usr/bin/chromedriver", f"--port={self.port}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
                    "binary": "/usr/bin/chromium",
                    "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--window-size=1400,1000"]}}}}
                self.session = self.call("POST", "/session", caps)["sessionId"]
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("chromedriver gave no session")

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["value"]

    def s(self, method, path, body=None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def element(self, css, wait=60):
        deadline = time.time() + wait
        while time.time() < deadline:
            found = self.s("POST", "/elements", {"using": "css selector", "value": css})
            if found:
                return list(found[0].values())[0]
            time.sleep(0.2)
        raise SystemExit(f"no {css} on the page")

    def cpu(self):
        """CPU seconds of chromedriver and every browser process under it."""
        total, todo = 0.0, [self.driver.pid]
        while todo:
            p = todo.pop()
            total += cpu_or_zero(p)
            todo.extend(children_of(p))
        return total

    def close(self):
        try:
            self.s("DELETE", "")
        finally:
            self.driver.kill()
            self.driver.wait()


def watch_bytes():
    """Characters (bytes: the events are ASCII JSON) of watch events the console's page has
    been sent so far, as the page counts them."""
    return browser.s("POST", "/execute/sync",
                     {"script": "return window.propellerConsoleStats.watchCharacters", "args": []})


def measure(with_browser):
    a_cpu, a_t = cpu_seconds(pid), time.time()
    b_cpu = browser.cpu() if with_browser else 0.0
    a_bytes = watch_bytes() if with_browser else 0
    a_writes = fleet_metrics(api)["proplet_writes"]
    rss = []
    while time.time() < a_t + window:
        rss.append(rss_mib(pid))
        time.sleep(1)
    span = time.time() - a_t
    row = {"browser": with_browser, "cpu": (cpu_seconds(pid) - a_cpu) / span * 100, "rss": max(rss),
           "browser_cpu": ((browser.cpu() - b_cpu) / span * 100) if with_browser else 0.0,
           "watch_kib_s": ((watch_bytes() - a_bytes) / span / 1024) if with_browser else 0.0,
           "writes": (fleet_metrics(api)["proplet_writes"] - a_writes) / span}
    print(f"window {'with' if with_browser else 'without'} the browser: propeller {row['cpu']:.1f}% CPU, "
          f"RSS {row['rss']:.0f} MiB; Proplet status writes {row['writes']:.0f}/s; "
          f"browser {row['browser_cpu']:.1f}% CPU; watch events {row['watch_kib_s']:.0f} KiB/s")
    return row


rows = []
sign_ins = []
browser = None
for with_browser in [False, True, False, True]:
    if with_browser:
        browser = WebDriver()
        sign_in_cpu = cpu_seconds(pid)
        browser.s("POST", "/url", {"url": f"http://127.0.0.1:{api_port}/console/"})
        token = browser.element("#token")
        browser.s("POST", f"/element/{token}/value", {"text": api.token})
        browser.s("POST", f"/element/{browser.element('#sign-in')}/click", {})
        t = time.time()
        # The fleet's summary names every proplet once the watch has sent them all.
        browser.element(f'tr[data-name="hb-0"]', wait=120)
        while True:
            text = browser.s("GET", f"/element/{browser.element('.summary')}/text")
            if text.startswith(f"{n} proplets"):
                break
            if time.time() - t > 120:
                raise SystemExit(f"the page never showed all proplets: {text!r}")
            time.sleep(0.5)
        took = time.time() - t
        synced = watch_bytes()
        sign_ins.append((took, cpu_seconds(pid) - sign_in_cpu, synced))
        print(f"signed in; the Fleet page showed all {n} proplets {took:.1f} s after signing in, "
              f"having been sent {synced / 1048576:.1f} MiB of watch events; propeller spent "
              f"{sign_ins[-1][1]:.2f} s of CPU from opening the page to that")
        rows.append(measure(True))
        browser.close()
        browser = None
    else:
        rows.append(measure(False))

load.terminate()
load.wait()
without = [r for r in rows if not r["browser"]]
with_ = [r for r in rows if r["browser"]]
med = lambda rs, k: statistics.median(r[k] for r in rs)
print()
print("| measure | without a browser | one browser on the Fleet page |")
print("|---|---|---|")
print(f"| propeller CPU (% of one core), median of {len(without)} / {len(with_)} windows of {window} s "
      f"| {med(without, 'cpu'):.1f} | {med(with_, 'cpu'):.1f} |")
print(f"| propeller RSS (max) | {max(r['rss'] for r in without):.0f} MiB | {max(r['rss'] for r in with_):.0f} MiB |")
print(f"| Proplet status writes (each one watch event to the page) | {med(without, 'writes'):.0f}/s | {med(with_, 'writes'):.0f}/s |")
print(f"| the browser's CPU | - | {med(with_, 'browser_cpu'):.1f}% |")
print(f"| watch events sent to the page | - | {med(with_, 'watch_kib_s'):.0f} KiB/s |")
took = statistics.median(x[0] for x in sign_ins)
cpu = statistics.median(x[1] for x in sign_ins)
size = statistics.median(x[2] for x in sign_ins)
print(f"| signing in: all {n} proplets on the page | - | {took:.1f} s, {size / 1048576:.1f} MiB sent, {cpu:.2f} s of propeller CPU |")
print(f"console files (page, script, style sheet): {console_bytes} bytes, {console_bytes / 1024:.1f} KiB, uncompressed")
