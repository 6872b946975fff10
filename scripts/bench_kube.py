"""A kube-apiserver as the Kubernetes-mode benchmark uses it: bearer-token HTTPS calls and
watches, read from a kubeconfig that `propeller-envtest` wrote. Imported by
`scripts/bench-k8s.sh`."""
import http.client
import json
import ssl
import urllib.parse

from bench_api import kept_alive_request, parse_metrics

GROUP = "/apis/propeller.propeller.absmach.eu/v1"


def _kubeconfig(path):
    """(host, port, token, CA file) of the kubeconfig's one cluster and user."""
    server = token = ca = None
    with open(path) as f:
        for line in f:
            key, _, value = line.strip().partition(": ")
            if key == "server":
                server = value
            elif key == "token":
                token = value
            elif key == "certificate-authority":
                ca = value
    url = urllib.parse.urlparse(server)
    return url.hostname, url.port, token, ca


class Kube:
    """One kept-alive HTTPS connection to the API server; use it from one thread at a time."""

    def __init__(self, kubeconfig, timeout=120):
        self.host, self.port, self.token, ca = _kubeconfig(kubeconfig)
        self.context = ssl.create_default_context(cafile=ca)
        self.timeout = timeout
        self.conn = None

    def _connect(self):
        return http.client.HTTPSConnection(self.host, self.port, context=self.context,
                                           timeout=self.timeout)

    def raw(self, method, path, body=None, ok=(200, 201), content_type="application/json"):
        """The answer's body; any status outside `ok` ends the script with its message."""
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": content_type}
        return kept_alive_request(self, self._connect, method, path, body, headers, ok)

    def call(self, method, path, obj=None):
        """The answer as JSON; `obj` is sent as JSON."""
        body = None if obj is None else json.dumps(obj)
        return json.loads(self.raw(method, path, body))

    def watch(self, path, resource_version):
        """An iterator of the watch events (dicts) of `path` from `resource_version`, on a
        connection of its own that is open when this returns."""
        conn = self._connect()
        sep = "&" if "?" in path else "?"
        conn.request("GET", f"{path}{sep}watch=1&resourceVersion={resource_version}",
                     headers={"Authorization": f"Bearer {self.token}"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"watch {path}: {r.status} {r.read()[:300]!r}")

        def events():
            buf = b""
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)

        return events()

    def metrics(self):
        """`(name, labels, value)` of every sample the API server exports."""
        return parse_metrics(self.raw("GET", "/metrics").decode())


def secret(name, key):
    """A Secret holding one proplet's MQTT key."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-key"},
            "stringData": {"key": key}}


def proplet(name, mqtt_port, labels=None):
    """An external Proplet on channel d/c whose device logs in as `name`."""
    return {"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"type": "external", "connectionConfig": {
                "mqttAddress": f"tcp://127.0.0.1:{mqtt_port}", "domainId": "d", "channelId": "c",
                "clientId": name, "clientKeySecretRef": {"name": f"{name}-key", "key": "key"}}}}


def add_task(name, file_b64):
    """A Task computing add(10, 32)."""
    return {"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
            "metadata": {"name": name},
            "spec": {"name": name, "functionName": "add", "file": file_b64, "inputs": [10, 32]}}
