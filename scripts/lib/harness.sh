# Sourced by the bench and fault scripts: the Python they run their measuring programs with,
# free ports, `propeller standalone` on them, and a real control plane.
#
#   "$PYTHON" scripts/PROGRAM.py ...
#
# PYTHON is Debian's python3 with python3-psutil (process figures) and
# python3-prometheus-client (the /metrics parser), installed here when missing.
#
#   start_standalone PROPELLER DATA_DIR LOG [FLAG...]
#
# Starts `PROPELLER standalone` with its data in DATA_DIR, MQTT and API on free loopback ports
# and its output in LOG (RUST_LOG from the caller's environment); sets MQTT, API and
# STANDALONE_PID once its API token is written.
#
#   start_control_plane DIR BIN
#
# Starts `BIN/propeller-envtest` (etcd and kube-apiserver on free loopback ports, data under
# DIR; $ENVTEST_ARGS added to its arguments) and writes DIR/propeller.kubeconfig: the same cluster, authenticated as the
# ServiceAccount propeller-system/propeller that configs/rbac binds. Sets ENVTEST_PID,
# APISERVER_PID and KUBECONFIG (the admin's). The caller stops ENVTEST_PID.
#
#   fit_proplets_to_descriptors
#
# Raises this shell's descriptor limit to its hard limit and lowers N (the proplets a bench
# connects, each a descriptor in propeller and one in the load generator) to what it allows,
# saying so; exports PROPELLER_MAX_CONNECTIONS for them and a few other clients.
#
#   scratch_workspace
#
# Sets WORK (a new temporary directory) and PIDS (empty: the caller adds each process it
# starts); on exit every pid in PIDS is killed and waited for, and WORK removed.

use_debian_python() {
  PYTHON=/usr/bin/python3
  if ! "$PYTHON" -c 'import psutil, prometheus_client' 2>/dev/null; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "installing python3-psutil python3-prometheus-client" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      python3 python3-psutil python3-prometheus-client >/dev/null
  fi
  export PYTHON PYTHONDONTWRITEBYTECODE=1
}
use_debian_python

start_standalone() {
  local propeller=$1 data=$2 log=$3
  shift 3
  MQTT=$(free_port)
  API=$(free_port)
  "$propeller" standalone --data-dir "$data" --mqtt-listen "127.0.0.1:$MQTT" \
    --api-listen "127.0.0.1:$API" "$@" >"$log" 2>&1 &
  STANDALONE_PID=$!
  for _ in $(seq 1 100); do [ -s "$data/api-token" ] && return 0; sleep 0.1; done
  echo "propeller standalone wrote no API token within 10 s:" >&2
  tail -n 20 "$log" >&2
  return 1
}

start_control_plane() {
  local dir=$1 bin=$2
  mkdir -p "$dir"
  # ENVTEST_ARGS: more arguments for propeller-envtest (e.g. --sharded-list-and-watch).
  # shellcheck disable=SC2086
  "$bin/propeller-envtest" --dir "$dir" ${ENVTEST_ARGS:-} >"$dir/envtest.log" 2>&1 &
  ENVTEST_PID=$!
  for _ in $(seq 1 120); do [ -f "$dir/admin.kubeconfig" ] && break; sleep 0.5; done
  if [ ! -f "$dir/admin.kubeconfig" ]; then
    cat "$dir/envtest.log" >&2
    return 1
  fi
  export KUBECONFIG="$dir/admin.kubeconfig"
  kubectl config view --minify --flatten > "$dir/propeller.kubeconfig"
  kubectl --kubeconfig "$dir/propeller.kubeconfig" config set-credentials propeller \
    --token="$(kubectl -n propeller-system create token propeller --duration=24h)" >/dev/null
  kubectl --kubeconfig "$dir/propeller.kubeconfig" config set-context --current \
    --user=propeller --namespace=propeller-system >/dev/null
  APISERVER_PID=$(pgrep -P "$ENVTEST_PID" -f kube-apiserver || true)
}

# Prints a free TCP port on 127.0.0.1 (bench_api.free_port: from below the ephemeral range).
free_port() {
  PYTHONPATH="$(dirname "${BASH_SOURCE[0]}")/.." \
    "$PYTHON" -c 'from bench_api import free_port; print(free_port())'
}

scratch_workspace() {
  WORK="$(mktemp -d)"
  PIDS=()
  trap stop_workspace EXIT
}

stop_workspace() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}

fit_proplets_to_descriptors() {
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
  local limit max
  limit=$(ulimit -n)
  max=$(( limit - 2000 ))
  if [ "$N" -gt "$max" ]; then
    echo "note: the descriptor limit here is $limit (ulimit -Hn), which allows $max proplets; running $max instead of $N"
    N=$max
  fi
  export PROPELLER_MAX_CONNECTIONS=$(( N + 100 ))
}
