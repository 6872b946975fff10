#!/usr/bin/env bash
# OCI image benchmark: `propeller standalone` with 10 local agents and Debian's
# docker-registry, all on 127.0.0.1.
#
#   scripts/bench-oci.sh
#   OCI_AGENTS=100 OCI_SIZES=10000000 scripts/bench-oci.sh    # the same with 100 agents
#
# For a 1 MB and a 10 MB `add` module, to 1 agent and to 10 (a broadcast task): the time from
# the Task's apply to its completion (1 ms polling),
#   * cold:   an image neither propeller nor the agents have seen (pull, verify, cache, chunks),
#   * cached: the same image again (manifest check, cache hit, chunks),
#   * http:   the same bytes as an `http://` imageUrl that each agent fetches itself,
# 3 runs each (median, min, max), with the registry pulls and chunk transfers they caused (from
# /metrics) and the longest gap between the agents' 1 s heartbeats as propeller recorded them.
# Then the OCI cases again with chunk publishing unpaced (--image-chunk-rate 0).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/bin/docker-registry ] || { echo "needs Debian's docker-registry (apt-get install docker-registry)" >&2; exit 1; }
scripts/build-release.sh
BIN=target/release
WORK="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
source scripts/lib/harness.sh
MQTT=$(free_port); API=$(free_port); REG=$(free_port); WEB=$(free_port)

cat >"$WORK/registry.yml" <<YML
version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $WORK/registry
http:
  addr: 127.0.0.1:$REG
YML
/usr/bin/docker-registry serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
PIDS+=($!)
mkdir -p "$WORK/www"
# The HTTP comparison: a threaded file server with a listen backlog of 128 (http.server's
# default of 5 drops the SYNs of 10 agents fetching at once, which costs them 1 s retries).
"$PYTHON" scripts/serve_files.py "$WEB" "$WORK/www" >/dev/null 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$REG") 2>/dev/null && break; sleep 0.1; done

"$PYTHON" scripts/bench_oci.py "$API" "$WORK" "$MQTT" "$BIN" "$REG" "$WEB"
