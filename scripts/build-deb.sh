#!/usr/bin/env bash
# Builds the Debian package `proplet` (the agent as a systemd service: see
# [package.metadata.deb] in proplet-agent/Cargo.toml and configs/deb/) with cargo-deb.
#
#   scripts/build-deb.sh [--no-build] [amd64|arm64|armhf ...]   (default: all three)
#
#   amd64        cargo-deb builds the agent for this machine and packages it
#   arm64        aarch64-unknown-linux-gnu, built by scripts/build-agent-cross.sh
#   armhf        armv7-unknown-linux-gnueabihf, likewise (Wasm runs on Pulley there)
#   --no-build   package the binaries already built (target/[TRIPLE/]PROFILE_DIR/proplet),
#                as scripts/test.sh and scripts/build-agent-cross.sh leave them
#
#   AGENT_PROFILE (or PROFILE)   cargo profile (default release-agent, the binary for devices;
#                  dev builds in a fraction of the time, for tests: cargo-deb warns that it
#                  does not support dev, and packages it all the same, compressed with --fast)
#   CARGO_TARGET_DIR is honoured as by cargo (default target).
#
# Installs cargo-deb (cargo install --locked cargo-deb) when it is missing. Output:
# <target dir>/debian/proplet_<version>-<revision>_<arch>.deb; the path of each package is
# printed on stdout, one per line; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "error: $*" >&2; exit 2; }

build=1 arches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    -h|--help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    amd64|arm64|armhf) arches+=("$1") ;;
    *) die "unknown argument $1 (amd64, arm64, armhf or --no-build)" ;;
  esac
  shift
done
[ ${#arches[@]} -eq 0 ] && arches=(amd64 arm64 armhf)
profile=${AGENT_PROFILE:-${PROFILE:-release-agent}}
# A dev package is for tests: its large unoptimised binary is compressed fast.
fast=()
case "$profile" in
  dev) profile_dir=debug fast=(--fast) ;;
  *) profile_dir=$profile ;;
esac
target_dir=${CARGO_TARGET_DIR:-target}
out_dir=$target_dir/debian
mkdir -p "$out_dir"

if ! cargo deb --version >/dev/null 2>&1; then
  echo "installing cargo-deb (cargo install --locked cargo-deb)" >&2
  cargo install --locked cargo-deb >&2
fi

# cargo-deb, with the variables in deb_env; it prints the package's path as its last line.
# The package's changelog (configs/deb/changelog) must have an entry for its version.
deb_env=()
deb() {
  local out package version logged
  out=$(env "${deb_env[@]}" cargo deb -p proplet-agent --locked --profile "$profile" "${fast[@]}" --output "$out_dir/" "$@") \
    || die "cargo deb $* failed (its output is above)"
  package=$(echo "$out" | tail -1)
  version=$(dpkg-deb -f "$package" Version)
  logged=$(sed -n '1s/^proplet (\([^)]*\)).*/\1/p' configs/deb/changelog)
  [ "$version" = "$logged" ] \
    || die "$package is version $version but the newest entry of configs/deb/changelog is ${logged:-unreadable}: add an entry for $version at its top"
  echo "$package"
}

for arch in "${arches[@]}"; do
  case "$arch" in
    amd64)
      [ "$(dpkg --print-architecture 2>/dev/null || echo amd64)" = amd64 ] \
        || die "amd64 is built natively: run this on an amd64 machine"
      if [ "$build" = 1 ]; then
        deb
      else
        [ -x "$target_dir/$profile_dir/proplet" ] \
          || die "no agent at $target_dir/$profile_dir/proplet: build it (cargo build --profile $profile -p proplet-agent) or drop --no-build"
        deb --no-build
      fi
      ;;
    arm64|armhf)
      if [ "$arch" = arm64 ]; then triple=aarch64-unknown-linux-gnu gnu=aarch64-linux-gnu
      else triple=armv7-unknown-linux-gnueabihf gnu=arm-linux-gnueabihf; fi
      bin=$target_dir/$triple/$profile_dir/proplet
      if [ "$build" = 1 ]; then
        AGENT_PROFILE=$profile scripts/build-agent-cross.sh "$triple" >/dev/null
      fi
      [ -x "$bin" ] \
        || die "no agent at $bin: build it (AGENT_PROFILE=$profile scripts/build-agent-cross.sh $triple) or drop --no-build"
      command -v "$gnu-strip" >/dev/null 2>&1 \
        || die "no $gnu-strip: apt-get install binutils-$gnu (scripts/build-agent-cross.sh installs it)"
      # The target's strip and objcopy (cargo-deb reads STRIP_<debian triple>), and the
      # `cross` variant of the metadata, which states the libc6 dependency that $auto cannot
      # find for a foreign architecture (see proplet-agent/Cargo.toml).
      deb_env=("STRIP_$gnu=$gnu-strip" "OBJCOPY_$gnu=$gnu-objcopy")
      package=$(deb --no-build --target "$triple" --variant cross)
      deb_env=()
      # That dependency must cover the newest glibc symbol version the binary uses.
      needs=$("$gnu-objdump" -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
      declared=$(dpkg-deb -f "$package" Depends | sed -n 's/.*libc6 (>= \([0-9.]*\)).*/\1/p')
      [ -n "$needs" ] && [ -n "$declared" ] && dpkg --compare-versions "$needs" le "$declared" \
        || die "$bin needs glibc $needs but $package declares libc6 (>= ${declared:-?}): update [package.metadata.deb.variants.cross] in proplet-agent/Cargo.toml"
      echo "$package"
      ;;
  esac
done
