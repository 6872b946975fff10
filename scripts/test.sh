#!/usr/bin/env bash
# Runs the whole test suite. The end-to-end tests in tests/ start the real binaries, so
# those are built first.
#
# It installs what the tests use as real peers when it is missing (as root or with sudo),
# and the wasm32-wasip2 Rust target for the guests the tests build:
# Debian's mosquitto-clients, docker-registry (the CNCF distribution registry, for the OCI
# image tests), etcd-server for the real-cluster tests, and rabbitmq-server and nats-server
# for the external-broker suites (each starts a 3-node cluster of its own). Those tests also
# need kube-apiserver and kube-controller-manager: from $KUBEBUILDER_ASSETS, or unpacked
# from ../shared/envtest beside the repository; the in-cluster suite also needs root and the
# node kit in ../shared/envtest/node (with containerd, runc and the CNI plugins, installed
# here). The Debian package test (tests/deb_package.rs) needs root, lintian and cargo-deb
# (installed here too), the dashboards test (tests/dashboards.rs) Debian's prometheus
# (prometheus and promtool), and the console test (tests/console.rs) Debian's chromium and
# chromium-driver. Without them they print SKIPPED and pass, except under CI=true,
# where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v mosquitto_pub >/dev/null 2>&1 || missing+=(mosquitto-clients)
command -v etcd >/dev/null 2>&1 || [ -x "${KUBEBUILDER_ASSETS:-/nonexistent}/etcd" ] \
  || missing+=(etcd-server)
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
[ -x /usr/bin/docker-registry ] || missing+=(docker-registry)
# The external-broker suites start 3-node clusters of their own on loopback ports.
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
# The in-cluster suite (tests/in_cluster.rs) starts a real node from ../shared/envtest/node:
# containerd and runc run its pods, dnsmasq-base serves its cluster DNS, iptables carries
# kube-proxy's Services; binutils' objcopy strips the binaries put into the test images.
# The Debian package test (tests/deb_package.rs) checks the package with lintian and its
# unit with systemd's systemd-analyze.
# The clock-skew test (tests/clock_skew.rs) runs an agent under faketime.
# The dashboards test (tests/dashboards.rs) runs Prometheus and promtool on the chart's
# dashboards and alert rules (it starts its own server on a free port).
# The console test (tests/console.rs) drives Debian's headless Chromium through its
# chromedriver; DejaVu gives the pages (and their screenshots) a font.
for tool in containerd:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins \
  iptables:iptables nft:nftables dnsmasq:dnsmasq-base /bin/busybox:busybox-static \
  openssl:openssl xz:xz-utils ip:iproute2 objcopy:binutils curl:curl \
  lintian:lintian systemd-analyze:systemd faketime:faketime promtool:prometheus \
  /usr/bin/chromium:chromium /usr/bin/chromedriver:chromium-driver \
  /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf:fonts-dejavu-core; do
  probe=${tool%%:*}
  if [ "${probe#/}" != "$probe" ]; then [ -e "$probe" ] || missing+=("${tool#*:}")
  else command -v "$probe" >/dev/null 2>&1 || missing+=("${tool#*:}"); fi
done
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
  # Packages must not start their services (rabbitmq-server's default node, etcd): the
  # tests start their own on free ports. A policy-rc.d that denies starts is what Debian
  # offers for that; any one already there is kept.
  added_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    added_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ -n "$added_policy" ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
fi
# Debian starts an etcd service on install; the tests start their own on free ports.
# So does the registry (on :5000), and containerd; the tests start their own.
for service in etcd docker-registry rabbitmq-server nats-server containerd; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
    systemctl stop "$service" >/dev/null 2>&1 || true
  fi
done
command -v cargo-nextest >/dev/null 2>&1 || cargo install --locked cargo-nextest
# The Debian package test builds its packages with cargo-deb (scripts/build-deb.sh).
command -v cargo-deb >/dev/null 2>&1 || cargo install --locked cargo-deb
# The agent's tests build a WASI 0.2 guest from source (tests/guests).
rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2

# The second agent the upgrade tests install (tests/agent_upgrades.rs), built with another
# version; it leaves the ordinary binaries built.
scripts/build-upgrade-agent.sh
# The binaries with the tests' feature set (dev-dependencies included), so that nextest's
# build reuses every crate instead of compiling the dependencies a second time.
cargo build --workspace --bins --tests
cargo nextest run --workspace --no-fail-fast "$@"
