#!/usr/bin/env bash
# Builds the proplet agent for Raspberry Pi class devices:
#   aarch64-unknown-linux-gnu      (64-bit Raspberry Pi OS, Pi 3/4/5)
#   armv7-unknown-linux-gnueabihf  (32-bit Raspberry Pi OS; Wasm runs on Wasmtime's Pulley interpreter)
# Usage: scripts/build-agent-cross.sh [TARGET...]   (default: both)
# Output: target/<triple>/release-agent/proplet
set -euo pipefail
cd "$(dirname "$0")/.."

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)

sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"

for target in "${targets[@]}"; do
  case "$target" in
    aarch64-unknown-linux-gnu) gcc=aarch64-linux-gnu-gcc; pkg=gcc-aarch64-linux-gnu ;;
    armv7-unknown-linux-gnueabihf) gcc=arm-linux-gnueabihf-gcc; pkg=gcc-arm-linux-gnueabihf ;;
    *) echo "unsupported target: $target" >&2; exit 2 ;;
  esac
  if ! command -v "$gcc" >/dev/null 2>&1; then
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$pkg" libc6-dev-"${pkg#gcc-}"-cross >/dev/null \
      || DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$pkg"
  fi
  rustup target list --installed | grep -qx "$target" || rustup target add "$target"

  triple_env=$(echo "$target" | tr 'a-z-' 'A-Z_')
  export "CARGO_TARGET_${triple_env}_LINKER=$gcc"
  export "CC_${target//-/_}=$gcc"
  cargo build --locked --profile release-agent -p proplet-agent --bin proplet --target "$target"
  bin="target/$target/release-agent/proplet"
  file "$bin"
  ls -l "$bin"
done
