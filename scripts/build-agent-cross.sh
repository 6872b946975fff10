#!/usr/bin/env bash
# Builds the proplet agent for Raspberry Pi class devices:
#   aarch64-unknown-linux-gnu      (64-bit Raspberry Pi OS, Pi 3/4/5)
#   armv7-unknown-linux-gnueabihf  (32-bit Raspberry Pi OS; Wasm runs on Wasmtime's Pulley interpreter)
# Usage: scripts/build-agent-cross.sh [TARGET...]   (default: both)
#   AGENT_PROFILE  cargo profile (default release-agent, the binary to put on a device; dev
#                  builds in about a third of the time, for scripts/check-agents-qemu.sh)
#   CARGO_TARGET_DIR is honoured as by cargo (default target).
# Output: <target dir>/<triple>/<profile dir>/proplet (dev's directory is debug). The path of
# each binary built is printed on stdout, one per line; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
profile=${AGENT_PROFILE:-release-agent}
case "$profile" in
  dev) profile_dir=debug ;;
  *) profile_dir=$profile ;;
esac
target_dir=${CARGO_TARGET_DIR:-target}

sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"

for target in "${targets[@]}"; do
  case "$target" in
    aarch64-unknown-linux-gnu) gnu=aarch64-linux-gnu; libc=libc6-dev-arm64-cross ;;
    armv7-unknown-linux-gnueabihf) gnu=arm-linux-gnueabihf; libc=libc6-dev-armhf-cross ;;
    *) echo "unsupported target: $target (aarch64-unknown-linux-gnu or armv7-unknown-linux-gnueabihf)" >&2; exit 2 ;;
  esac
  gcc=$gnu-gcc
  # The compiler (ring and Wasmtime's helpers have C parts, and it links) and the target's libc.
  if ! command -v "$gcc" >/dev/null 2>&1 || [ ! -e "/usr/$gnu/lib/crt1.o" ]; then
    echo "installing gcc-$gnu and $libc" >&2
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "gcc-$gnu" "$libc" >/dev/null
  fi
  rustup target list --installed | grep -qx "$target" || rustup target add "$target" >&2

  triple_env=$(echo "$target" | tr 'a-z-' 'A-Z_')
  export "CARGO_TARGET_${triple_env}_LINKER=$gcc"
  export "CC_${target//-/_}=$gcc"
  cargo build --locked --profile "$profile" -p proplet-agent --bin proplet --target "$target" >&2
  bin="$target_dir/$target/$profile_dir/proplet"
  file "$bin" >&2
  ls -l "$bin" >&2
  echo "$bin"
done
