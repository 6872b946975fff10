# Sourced by the bench and fault scripts: free ports and a real control plane.
#
#   start_control_plane DIR BIN
#
# Starts `BIN/propeller-envtest` (etcd and kube-apiserver on free loopback ports, data under
# DIR) and writes DIR/propeller.kubeconfig: the same cluster, authenticated as the
# ServiceAccount propeller-system/propeller that configs/rbac binds. Sets ENVTEST_PID,
# APISERVER_PID and KUBECONFIG (the admin's). The caller stops ENVTEST_PID.

start_control_plane() {
  local dir=$1 bin=$2
  mkdir -p "$dir"
  "$bin/propeller-envtest" --dir "$dir" >"$dir/envtest.log" 2>&1 &
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
  PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$(dirname "${BASH_SOURCE[0]}")/.." \
    python3 -c 'from bench_api import free_port; print(free_port())'
}
