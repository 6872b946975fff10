#!/usr/bin/env bash
# The fault suite: each case in scripts/faults/ drives real processes, prints what it did
# and what it counted, and exits non-zero when the case fails. RELIABILITY.md records the
# figures of the last runs.
#
#   scripts/faults.sh              # every case
#   scripts/faults.sh NAME [NAME…] # the named cases (file names without .sh)
#   scripts/faults.sh --list       # the cases
#
# Cases build what they need themselves (release binaries through scripts/build-release.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
cases_dir=scripts/faults
if [ "${1:-}" = "--list" ]; then
  for f in "$cases_dir"/*.sh; do basename "$f" .sh; done
  exit 0
fi
if [ $# -gt 0 ]; then
  names=("$@")
else
  names=()
  for f in "$cases_dir"/*.sh; do names+=("$(basename "$f" .sh)"); done
fi
failed=()
for name in "${names[@]}"; do
  script="$cases_dir/$name.sh"
  if [ ! -f "$script" ]; then
    echo "error: no fault case $name (scripts/faults.sh --list)" >&2
    exit 2
  fi
  echo "=== fault case: $name"
  start=$(date +%s)
  if bash "$script"; then
    echo "=== $name: passed in $(( $(date +%s) - start )) s"
  else
    echo "=== $name: FAILED after $(( $(date +%s) - start )) s"
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fault cases failed: ${failed[*]}"
  exit 1
fi
echo "all ${#names[@]} fault cases passed"
