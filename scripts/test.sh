#!/usr/bin/env bash
# Runs the whole test suite. The end-to-end tests in tests/ start the real binaries, so
# those are built first.
#
# It installs what the tests use as real peers when it is missing (as root or with sudo),
# and the wasm32-wasip2 Rust target for the guests the tests build:
# Debian's mosquitto-clients, docker-registry (the CNCF distribution registry, for the OCI
# image tests), and etcd-server for the real-cluster tests. Those tests also
# need kube-apiserver and kube-controller-manager: from $KUBEBUILDER_ASSETS, or unpacked
# from ../shared/envtest beside the repository. Without them they print SKIPPED and pass,
# except under CI=true, where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v mosquitto_pub >/dev/null 2>&1 || missing+=(mosquitto-clients)
command -v etcd >/dev/null 2>&1 || [ -x "${KUBEBUILDER_ASSETS:-/nonexistent}/etcd" ] \
  || missing+=(etcd-server)
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
[ -x /usr/bin/docker-registry ] || missing+=(docker-registry)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      SUDO="sudo"
    else
      echo "error: the tests need these Debian packages: ${missing[*]} (run as root or install them)" >&2
      exit 1
    fi
  fi
  echo "installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian starts an etcd service on install; the tests start their own on free ports.
# So does the registry (on :5000); the tests start their own on free ports.
for service in etcd docker-registry; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
    systemctl stop "$service" >/dev/null 2>&1 || true
  fi
done
command -v cargo-nextest >/dev/null 2>&1 || cargo install --locked cargo-nextest
# The agent's tests build a WASI 0.2 guest from source (tests/guests).
rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2

# The binaries with the tests' feature set (dev-dependencies included), so that nextest's
# build reuses every crate instead of compiling the dependencies a second time.
cargo build --workspace --bins --tests
cargo nextest run --workspace --no-fail-fast "$@"
