#!/bin/bash
# Alternates two checkouts' builds, one process each: bandwidth_ceiling.py on SmolLM2's shape, ROUNDS pairs.
#   benchmarks/results/host-ceiling-s47/alternate.sh /tmp/base /work/main 6 > pairs.log
#   python benchmarks/results/host-ceiling-s47/by_state.py pairs.log
# (a base checkout: `git worktree add -f /tmp/base REV`; each loads its own kernel build, keyed by its sources)
BASE=$1 NEW=$2 ROUNDS=${3:-3}
PYTHON=${PYTHON:-$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python}
for _ in $(seq "$ROUNDS"); do
  for tree in "$BASE" "$NEW"; do
    echo "== $tree $(date +%T)"
    (cd "$tree" && taskset -c 0,1 timeout 300 "$PYTHON" benchmarks/bandwidth_ceiling.py --shape smollm2-135m \
      --threads 2 --repeats 6 2>&1 | grep -E '^\| [0-9]|median|^\| (q/k/v|attention|o|gate/up|down) |Error')
  done
done
