#!/usr/bin/env bash
# Runs a command on a loaded machine: the project's one definition of "loaded" (docs/testing.md).
#   bash scripts/loaded.sh [--light|--heavy] COMMAND...
# light (the default): two busy loops, one per core of the 2-core CI machine — collective deadlines and teardown
#   races show as they do on a busy CI runner; every new multi-process test file runs once this way.
# heavy: four busy loops (each core oversubscribed twice) and a disk-churn loop (64 MiB written, synced and
#   removed, over and over: what a large `pip install` beside a run does) — the level teardown races need
#   (the clean-exit measurement, tests/distributed/test_clean_exit.py).
# The loops run at normal priority; they are killed when the command ends (its exit status is returned).
set -euo pipefail
cd "$(dirname "$0")/.."
level=light
case "${1:-}" in
  --light) level=light; shift ;;
  --heavy) level=heavy; shift ;;
esac
[ $# -gt 0 ] || { echo "usage: bash scripts/loaded.sh [--light|--heavy] COMMAND..." >&2; exit 2; }
pids=()
busy() { while :; do :; done; }
churn() {
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/accel_fp8_fix_churn.XXXXXX")
  trap 'rm -rf "$dir"' EXIT
  while :; do dd if=/dev/zero of="$dir/blob" bs=1M count=64 conv=fsync status=none; rm -f "$dir/blob"; done
}
loops=2
[ "$level" = heavy ] && loops=4
for _ in $(seq "$loops"); do busy & pids+=($!); done
if [ "$level" = heavy ]; then churn & pids+=($!); fi
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
echo "loaded.sh: $level load ($loops busy loops$([ "$level" = heavy ] && echo ', disk churn')) beside: $*" >&2
"$@"
