#!/usr/bin/env bash
# Runs one cross-built proplet agent under qemu-user against a broker, in the foreground.
# scripts/check-agents-qemu.sh uses it; any other test may call it the same way.
#
#   scripts/run-agent-qemu.sh --target TRIPLE --broker ADDRESS --client-id ID [--client-key KEY]
#       [--bin PATH] [--domain-id D] [--channel-id C] [--state-dir DIR] [-- PROPLET_ARG...]
#
#   --target      aarch64-unknown-linux-gnu (run by qemu-aarch64) or
#                 armv7-unknown-linux-gnueabihf (qemu-arm; Wasm runs on Pulley there)
#   --broker      HOST:PORT (taken as tcp://HOST:PORT) or a full agent address
#                 (tcp://, mqtts://, several comma-separated), as PROPLET_MQTT_ADDRESS takes
#   --client-id   the Proplet's clientId (MQTT client id and username)
#   --client-key  the key in the Proplet's Secret (MQTT password); PROPLET_CLIENT_KEY in the
#                 environment instead keeps it out of the process list
#   --bin         the agent binary (default: target/TRIPLE/$AGENT_PROFILE/proplet from
#                 scripts/build-agent-cross.sh, AGENT_PROFILE defaulting to release-agent)
#   --domain-id, --channel-id   the Proplet's connectionConfig (defaults: default-domain,
#                 default-channel, as configs/samples/proplet-external.yaml)
#   --state-dir   the agent's spool and caches (default: the agent's own default)
#   after --       more proplet flags (`proplet --help`), e.g. --config FILE for a TOML file
#                  or --liveliness-interval 1s; PROPLET_* variables in the environment apply too
#
# The agent is exec'd: this script's pid is the agent's (qemu's), so the caller starts it in
# the background, keeps $!, and stops it with SIGTERM (qemu passes it to the agent, which
# exits cleanly). The agent's log goes to stderr. Needs Debian's qemu-user and the target's
# libc (libc6-dev-arm64-cross / libc6-dev-armhf-cross, which scripts/build-agent-cross.sh
# installs); qemu-user finds the libc through -L /usr/<gnu triple>.
set -euo pipefail

usage() {
  sed -n '5,6p' "$0" >&2
  echo "error: $1 (see the header of $0)" >&2
  exit 2
}

target="" bin="" broker="" client_id="" client_key=${PROPLET_CLIENT_KEY:-} domain_id=default-domain
channel_id=default-channel state_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target|--bin|--broker|--client-id|--client-key|--domain-id|--channel-id|--state-dir)
      [ $# -ge 2 ] || usage "$1 needs a value"
      case "$1" in
        --target) target=$2 ;; --bin) bin=$2 ;; --broker) broker=$2 ;;
        --client-id) client_id=$2 ;; --client-key) client_key=$2 ;;
        --domain-id) domain_id=$2 ;; --channel-id) channel_id=$2 ;; --state-dir) state_dir=$2 ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    *) usage "unknown argument $1" ;;
  esac
done
[ -n "$target" ] || usage "--target is required"
[ -n "$broker" ] || usage "--broker is required"
[ -n "$client_id" ] || usage "--client-id is required"
[ -n "$client_key" ] || usage "--client-key (or PROPLET_CLIENT_KEY) is required"

case "$target" in
  aarch64-unknown-linux-gnu) qemu="qemu-aarch64"; sysroot=/usr/aarch64-linux-gnu; libc=libc6-dev-arm64-cross ;;
  armv7-unknown-linux-gnueabihf) qemu="qemu-arm"; sysroot=/usr/arm-linux-gnueabihf; libc=libc6-dev-armhf-cross ;;
  *) usage "unsupported target $target (aarch64-unknown-linux-gnu or armv7-unknown-linux-gnueabihf)" ;;
esac
if [ -z "$bin" ]; then
  profile=${AGENT_PROFILE:-release-agent}
  [ "$profile" = dev ] && profile=debug
  bin="$(cd "$(dirname "$0")/.." && pwd)/${CARGO_TARGET_DIR:-target}/$target/$profile/proplet"
fi
command -v "$qemu" >/dev/null 2>&1 \
  || { echo "error: $qemu not found: apt-get install qemu-user" >&2; exit 1; }
[ -e "$sysroot/lib/libc.so.6" ] \
  || { echo "error: no $target libc in $sysroot: apt-get install $libc" >&2; exit 1; }
[ -x "$bin" ] \
  || { echo "error: no agent at $bin: build it with scripts/build-agent-cross.sh $target (or pass --bin)" >&2; exit 1; }
case "$broker" in
  *://*) address=$broker ;;
  *) address=tcp://$broker ;;
esac

export PROPLET_MQTT_ADDRESS=$address PROPLET_CLIENT_ID=$client_id PROPLET_CLIENT_KEY=$client_key \
  PROPLET_DOMAIN_ID=$domain_id PROPLET_CHANNEL_ID=$channel_id
[ -n "$state_dir" ] && export PROPLET_STATE_DIR=$state_dir
# A binary the agent execs (an upgrade's new agent, or its previous one) is handed by the
# kernel to qemu through binfmt_misc (Debian's qemu-user-binfmt registers it), which finds
# the target's libc through QEMU_LD_PREFIX, inherited from here.
export QEMU_LD_PREFIX=$sysroot
exec "$qemu" -L "$sysroot" "$bin" "$@"
