#!/usr/bin/env bash
# Checks the cross-built agents as users flash them, under qemu-user: each connects to a
# broker, heartbeats until its Proplet is Running, and runs add(10, 32) = 42 (on armv7 through
# Wasmtime's Pulley interpreter); with --upgrade, then upgrades itself through a
# PropletUpgrade to a second build of the agent and runs add again on it.
#
#   scripts/check-agents-qemu.sh [--no-build] [--upgrade] [--broker HOST:PORT [--namespace NS]] [TARGET...]
#
#   TARGET       aarch64-unknown-linux-gnu, armv7-unknown-linux-gnueabihf (default: both)
#   --no-build   take the agents already built by scripts/build-agent-cross.sh
#   --upgrade    also build each agent with PROPLET_BUILD_VERSION=9.9.0-upgrade (into
#                target/upgrade-agent/TARGET/proplet; with --no-build, taken from there),
#                serve it over HTTP on loopback, and roll it out to the agent with a
#                PropletUpgrade pinned by its digest: the agent downloads and checks it and
#                execs it, which the kernel hands to qemu through binfmt_misc (Debian's
#                qemu-user-binfmt, installed when missing; needs root). PASS when the
#                rollout completes, the Proplet reports the new version and add runs on it.
#                Standalone only (the file server is on this machine's loopback).
#   --broker     use an existing broker (e.g. an in-cluster NodePort) instead of starting
#                `propeller standalone`: the Proplets, their Secrets and the Tasks are then
#                created with kubectl in the current context (namespace NS, default
#                `default`), whose operator must serve that broker; they are deleted at exit
#
#   AGENT_PROFILE   cargo profile of the agents (default dev: builds in about 2 minutes per
#                   target and runs add within a second under qemu; release-agent checks the
#                   binaries put on devices, built in several times as long)
#   PROPELLER_BIN   propeller for the standalone server and its client commands (default
#                   target/debug/propeller, built with cargo when missing)
#   CHECK_WAIT      seconds each step may take (default 120; an upgrade's rollout 5 times
#                   as long: the download is hashed under emulation)
#   CHECK_LIFETIME  seconds the server and each agent may live at most (default 900)
#
# Installs qemu-user and jq when missing. Without --broker, propeller standalone runs on
# ephemeral loopback ports with its data in a temporary directory, and is stopped at exit
# (by pid, and bounded by CHECK_LIFETIME if this script is killed). Each target's agent runs
# through scripts/run-agent-qemu.sh with its own Proplet (random name and key), is stopped
# after its task, and gets a PASS or FAIL line with its timings. Exits 1 when any target fails (the
# logs are then kept and their directory printed).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

die() { echo "error: $*" >&2; exit 2; }

build=1 upgrade=0 broker="" namespace="" targets=()
new_version=9.9.0-upgrade
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0; shift ;;
    --upgrade) upgrade=1; shift ;;
    --broker) [ $# -ge 2 ] || die "--broker needs HOST:PORT"; broker=$2; shift 2 ;;
    --namespace) [ $# -ge 2 ] || die "--namespace needs a value"; namespace=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /{/^set /!p}' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    aarch64-unknown-linux-gnu|armv7-unknown-linux-gnueabihf) targets+=("$1"); shift ;;
    *) die "unknown target $1 (aarch64-unknown-linux-gnu or armv7-unknown-linux-gnueabihf)" ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
export AGENT_PROFILE=${AGENT_PROFILE:-dev}
wait_s=${CHECK_WAIT:-120}
lifetime=${CHECK_LIFETIME:-900}
[[ $wait_s =~ ^[1-9][0-9]*$ ]] || die "CHECK_WAIT=$wait_s: give whole seconds"
[[ $lifetime =~ ^[1-9][0-9]*$ ]] || die "CHECK_LIFETIME=$lifetime: give whole seconds"
add_wasm=AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags= # tests/support ADD_WASM

# Debian packages it uses, installed when missing (as root or with sudo), as the build
# script installs the cross compilers.
missing=()
command -v jq >/dev/null 2>&1 || missing+=(jq)
command -v qemu-aarch64 >/dev/null 2>&1 && command -v qemu-arm >/dev/null 2>&1 || missing+=(qemu-user)
if [ "$upgrade" = 1 ]; then
  [ -n "$broker" ] && die "--upgrade runs against propeller standalone only (drop --broker)"
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] && [ -e /proc/sys/fs/binfmt_misc/qemu-arm ] \
    || missing+=(qemu-user-binfmt binfmt-support)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "installing ${missing[*]}" >&2
  { $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null; } \
    || die "could not install ${missing[*]}: apt-get install ${missing[*]} (as root), then run this again"
fi
if [ -n "$broker" ]; then
  command -v kubectl >/dev/null 2>&1 || die "--broker needs kubectl with a context that can create Proplets, Secrets and Tasks"
  namespace=${namespace:-default}
else
  [ -z "$namespace" ] || die "--namespace goes with --broker"
  propeller=${PROPELLER_BIN:-$root/target/debug/propeller}
  if [ ! -x "$propeller" ]; then
    [ -z "${PROPELLER_BIN:-}" ] || die "PROPELLER_BIN=$propeller is not an executable"
    echo "building propeller (cargo build -p propeller-operator --bin propeller)" >&2
    cargo build -p propeller-operator --bin propeller >&2
  fi
fi

if [ "$upgrade" = 1 ]; then
  for handler in qemu-aarch64 qemu-arm; do
    grep -qx enabled "/proc/sys/fs/binfmt_misc/$handler" 2>/dev/null \
      || die "no binfmt_misc handler $handler: mount binfmt_misc on /proc/sys/fs/binfmt_misc and run update-binfmts --enable $handler (as root)"
  done
fi

# The agents: built now (their paths are the build script's stdout) or taken as built. The
# upgrade's second agents first, so that the ordinary build is the one left in target/.
upgrade_bins=()
for target in "${targets[@]}"; do upgrade_bins+=("${CARGO_TARGET_DIR:-target}/upgrade-agent/$target/proplet"); done
if [ "$upgrade" = 1 ] && [ "$build" = 1 ]; then
  out=$(PROPLET_BUILD_VERSION=$new_version scripts/build-agent-cross.sh "${targets[@]}") \
    || die "scripts/build-agent-cross.sh (PROPLET_BUILD_VERSION=$new_version) failed (its output is above)"
  mapfile -t built <<<"$out"
  for i in "${!targets[@]}"; do
    mkdir -p "$(dirname "${upgrade_bins[$i]}")"
    cp "${built[$i]}" "${upgrade_bins[$i]}.partial" && mv "${upgrade_bins[$i]}.partial" "${upgrade_bins[$i]}"
  done
elif [ "$upgrade" = 1 ]; then
  for bin in "${upgrade_bins[@]}"; do
    [ -x "$bin" ] || die "no second agent at $bin: drop --no-build to build it"
  done
fi
if [ "$build" = 1 ]; then
  out=$(scripts/build-agent-cross.sh "${targets[@]}") || die "scripts/build-agent-cross.sh failed (its output is above)"
  mapfile -t bins <<<"$out"
else
  bins=()
  dir=$AGENT_PROFILE; [ "$dir" = dev ] && dir=debug
  for target in "${targets[@]}"; do
    bins+=("${CARGO_TARGET_DIR:-target}/$target/$dir/proplet")
    [ -x "${bins[-1]}" ] || die "no agent at ${bins[-1]}: build it with AGENT_PROFILE=$AGENT_PROFILE scripts/build-agent-cross.sh $target (or drop --no-build)"
  done
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/check-agents-qemu.XXXXXX")
server_pid="" agent_pid="" files_pid="" created=() failed=0
cleanup() {
  local status=$?
  [ -n "$agent_pid" ] && stop "$agent_pid"
  [ -n "$files_pid" ] && stop "$files_pid"
  [ -n "$server_pid" ] && stop "$server_pid"
  if [ -n "$broker" ] && [ ${#created[@]} -gt 0 ]; then
    kubectl -n "$namespace" delete --ignore-not-found --wait=false "${created[@]}" >/dev/null 2>&1 || true
  fi
  if [ "$status" -eq 0 ]; then rm -rf "$work"; else echo "logs kept in $work" >&2; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# SIGTERM to one of our processes (a `timeout` that forwards it), SIGKILL after 10 s.
stop() {
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d s' $(( $1 / 1000 )) $(( $1 % 1000 )); }
# The time from one RFC 3339 timestamp to another, or ? when either is missing.
span() {
  [ -n "$1" ] && [ -n "$2" ] && [ "$1" != null ] && [ "$2" != null ] || { echo "?"; return 0; }
  secs $(( $(date -d "$2" +%s%3N) - $(date -d "$1" +%s%3N) ))
}

# The control plane: propeller's client commands, or kubectl (with full kind names, since
# `task` may be another group's kind in a cluster).
if [ -n "$broker" ]; then
  proplet_kind=proplets.propeller.propeller.absmach.eu task_kind=tasks.propeller.propeller.absmach.eu
  ctl() { kubectl -n "$namespace" "$@"; }
  broker_address=$broker
  case "$broker" in *://*) broker_url=$broker ;; *) broker_url=tcp://$broker ;; esac
else
  proplet_kind=proplet task_kind=task
  data=$work/propeller
  timeout --signal=TERM "$lifetime" "$propeller" standalone --data-dir "$data" \
    --api-listen 127.0.0.1:0 --mqtt-listen 127.0.0.1:0 >"$work/propeller.out" 2>"$work/propeller.log" &
  server_pid=$!
  for _ in $(seq $(( wait_s * 10 ))); do
    grep -q 'api listening on' "$work/propeller.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  api=$(sed -n 's|.*api listening on http://\([^ ]*\).*|\1|p' "$work/propeller.out")
  mqtt=$(sed -n 's|.*mqtt listening on \([^ ]*\).*|\1|p' "$work/propeller.out")
  if [ -z "$api" ] || [ -z "$mqtt" ]; then
    cat "$work/propeller.out" "$work/propeller.log" >&2
    die "propeller standalone ($propeller) did not start"
  fi
  ctl() { "$propeller" "$@" --server "$api" --data-dir "$data"; }
  broker_address=$mqtt broker_url=tcp://$mqtt
  echo "propeller standalone: mqtt $mqtt, api $api, data $data"
fi

# Prints the object's .status.phase (empty while it cannot be read).
phase() { ctl get "$1" "$2" -o json 2>/dev/null | jq -r '.status.phase // empty' || true; }

# The second agents, served over HTTP on loopback.
if [ "$upgrade" = 1 ]; then
  files_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  timeout --signal=TERM "$lifetime" python3 scripts/serve_files.py "$files_port" \
    "${CARGO_TARGET_DIR:-target}/upgrade-agent" >"$work/files.log" 2>&1 &
  files_pid=$!
fi

# Runs add(10, 32) on the Proplet $1 as Task $2; prints the Task applied -> completed time,
# or its FAIL line and returns 1.
run_add() {
  local name=$1 task=$2 t0 ph json
  t0=$(now_ms)
  printf '%s\n' "apiVersion: propeller.propeller.absmach.eu/v1" "kind: Task" "metadata: {name: $task}" \
    "spec:" "  name: add" "  functionName: add" "  file: $add_wasm" "  inputs: [10, 32]" \
    "  propletSelector: {propletId: $name}" \
    | ctl apply -f - >/dev/null || { fail "could not create Task $task"; return 1; }
  while :; do
    ph=$(phase "$task_kind" "$task")
    case "$ph" in completed|failed|skipped|interrupted) break ;; esac
    [ $(( $(now_ms) - t0 )) -lt $(( wait_s * 1000 )) ] || { fail "Task $task still '$ph' after ${wait_s} s"; return 1; }
    sleep 0.1
  done
  json=$(ctl get "$task_kind" "$task" -o json)
  [ "$ph" = completed ] && [ "$(jq -r '.status.results' <<<"$json")" = 42 ] \
    || { fail "Task $task: $(jq -c '{phase: .status.phase, results: .status.results, error: .status.error}' <<<"$json")"; return 1; }
  echo "$(secs $(( $(now_ms) - t0 ))) (start sent -> result $(span "$(jq -r .status.startedAt <<<"$json")" "$(jq -r .status.finishedAt <<<"$json")"))"
}

# Rolls the second agent $3 out to the Proplet $1 (architecture $2), then runs add on it;
# prints the figures, or its FAIL line and returns 1.
upgrade_to_second_agent() {
  local name=$1 arch=$2 bin=$3 digest t0 ph rollout version pid_before pid_after asked installed healthy took
  digest=$(sha256sum "$bin" | cut -d' ' -f1)
  pid_before=$(pgrep -P "$agent_pid" | head -1)
  t0=$(now_ms)
  printf '%s\n' "apiVersion: propeller.propeller.absmach.eu/v1" "kind: PropletUpgrade" "metadata: {name: up-$name}" \
    "spec:" "  version: \"$new_version\"" "  selector: {qemu-check: $name}" "  artifacts:" \
    "  - arch: $arch" "    url: \"http://127.0.0.1:$files_port/${bin#*upgrade-agent/}#sha256=$digest\"" \
    "  waveSize: 1" "  failureThreshold: 1" "  healthSeconds: 300" "  deadlineSeconds: $(( wait_s * 5 ))" \
    | ctl apply -f - >/dev/null || { fail "could not create PropletUpgrade up-$name"; return 1; }
  while :; do
    ph=$(phase propletupgrade "up-$name")
    case "$ph" in Completed|Stopped) break ;; esac
    [ $(( $(now_ms) - t0 )) -lt $(( wait_s * 5000 )) ] || { fail "PropletUpgrade up-$name still '$ph' after $(( wait_s * 5 )) s"; return 1; }
    sleep 0.5
  done
  took=$(( $(now_ms) - t0 ))
  rollout=$(ctl get propletupgrade "up-$name" -o json)
  [ "$ph" = Completed ] || { fail "PropletUpgrade up-$name: $(jq -c '.status | {phase, message, proplets}' <<<"$rollout")"; return 1; }
  until [ "$(phase "$proplet_kind" "$name")" = Running ]; do sleep 0.2; done
  version=$(ctl get "$proplet_kind" "$name" -o json | jq -r '.status.metadata.propletVersion // empty')
  [ "$version" = "$new_version" ] || { fail "Proplet $name reports version '$version' after the rollout, not $new_version"; return 1; }
  pid_after=$(pgrep -P "$agent_pid" | head -1)
  [ "$pid_before" = "$pid_after" ] || { fail "the agent's process changed ($pid_before -> $pid_after): it did not exec the new agent"; return 1; }
  asked=$(sed -n 's/^\([^ ]*\) .*downloading a new agent.*/\1/p' "$log" | head -1)
  installed=$(sed -n 's/^\([^ ]*\) .*installed; restarting into it.*/\1/p' "$log" | head -1)
  healthy=$(sed -n 's/^\([^ ]*\) .*the new agent is healthy.*/\1/p' "$log" | head -1)
  add_after=$(run_add "$name" "add-new-$name") || { echo "$add_after"; return 1; }
  echo "upgraded to $new_version in the same process ($(( $(stat -c %s "$bin") / 1000000 )) MB): applied -> Completed $(secs "$took"); download and check $(span "$asked" "$installed"), exec -> healthy $(span "$installed" "$healthy") (agent's log); add(10, 32) = 42 on it: $add_after"
}

# Checks one target; prints its PASS line, or its FAIL line and returns 1.
check() {
  local target=$1 bin=$2 arch=${1%%-*} name key log t0 t_running t_task ph task started connected
  name="qemu-$arch-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
  key=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  log="$work/$name.log"
  fail() { echo "FAIL $target: $*"; echo "  agent log ($log):"; sed 's/^/    /' "$log" | tail -20; return 1; }

  [ -n "$broker" ] && created+=("secret/$name-key" "$proplet_kind/$name" "$task_kind/add-$name")
  local upgraded=""
  printf '%s\n' "apiVersion: v1" "kind: Secret" "metadata: {name: $name-key}" "stringData: {key: \"$key\"}" "---" \
    "apiVersion: propeller.propeller.absmach.eu/v1" "kind: Proplet" "metadata: {name: $name, labels: {qemu-check: $name}}" \
    "spec:" "  type: external" "  external: {capabilities: [wasm]}" "  connectionConfig:" \
    "    mqttAddress: $broker_url" "    domainId: qemu-check" "    channelId: $name" \
    "    clientId: $name" "    clientKeySecretRef: {name: $name-key, key: key}" \
    | ctl apply -f - >/dev/null || { echo "FAIL $target: could not register Proplet $name"; return 1; }

  t0=$(now_ms)
  PROPLET_CLIENT_KEY=$key timeout --signal=TERM "$lifetime" scripts/run-agent-qemu.sh --target "$target" \
    --bin "$bin" --broker "$broker_address" --client-id "$name" --domain-id qemu-check \
    --channel-id "$name" --state-dir "$work/$name" 2>"$log" &
  agent_pid=$!
  until [ "$(phase "$proplet_kind" "$name")" = Running ]; do
    kill -0 "$agent_pid" 2>/dev/null || { fail "the agent exited before its Proplet $name was Running"; return 1; }
    [ $(( $(now_ms) - t0 )) -lt $(( wait_s * 1000 )) ] || { fail "Proplet $name not Running within ${wait_s} s"; return 1; }
    sleep 0.1
  done
  t_running=$(( $(now_ms) - t0 ))
  started=$(sed -n 's/^\([^ ]*\) .*proplet starting.*/\1/p' "$log" | head -1)
  connected=$(sed -n 's/^\([^ ]*\) .*connected to the broker.*/\1/p' "$log" | head -1)

  t_task=$(run_add "$name" "add-$name") || { echo "$t_task"; return 1; }
  if [ "$upgrade" = 1 ]; then
    upgraded=$(upgrade_to_second_agent "$name" "$(case "$target" in aarch64-*) echo aarch64 ;; *) echo arm ;; esac)" "$3") || { echo "$upgraded"; return 1; }
  fi

  echo "PASS $target: agent started -> connected $(span "$started" "$connected") (agent's log)," \
    "-> Proplet Running $(secs "$t_running"); add(10, 32) = 42: Task applied -> completed $t_task"
  [ -z "$upgraded" ] || echo "  $upgraded"
}

for i in "${!targets[@]}"; do
  echo "${targets[$i]}: ${bins[$i]} ($(( $(stat -c %s "${bins[$i]}") / 1000000 )) MB, profile $AGENT_PROFILE)"
  check "${targets[$i]}" "${bins[$i]}" "${upgrade_bins[$i]}" || failed=1
  [ -z "$agent_pid" ] || stop "$agent_pid"
  agent_pid=""
done
exit "$failed"
