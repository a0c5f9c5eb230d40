#!/usr/bin/env bash
# Before/after on one machine in one run: a benchmark script of this repository run alternately on
# an earlier revision (a git worktree, removed afterwards) and on the working tree, ROUNDS times each,
# so both see the same load. Each run's output is printed under a header naming its side and round.
#   bash benchmarks/ab.sh REV benchmarks/bench_trainer.py 2 --steps 30 --rounds 1
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1 script=$2 rounds=$3
shift 3
root=$PWD before=$(mktemp -d /tmp/ab-before-XXXX)
git worktree add -q --detach "$before" "$rev"
trap 'git worktree remove --force "$before"' EXIT
for ((r = 1; r <= rounds; r++)); do
  for side in before after; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    echo "=== $side ($([ "$side" = before ] && echo "$rev" || echo "working tree")), round $r"
    (cd "$dir" && PYTHONPATH="$dir" "$root/.venv/bin/python" "$script" "$@")
  done
done
