#!/bin/bash
# bandwidth_ceiling.py (SmolLM2 as served, c=1) alternated between this tree and the base worktree at /tmp/base,
# each with its own LLMSERVE_CACHE (calibration); $1: rounds, $2: label for the log lines
rounds=${1:-3}
for r in $(seq $rounds); do
  for b in new base; do
    d=/work/main; [ $b = base ] && d=/tmp/base
    echo "=== $b round $r $(date +%T)"
    (cd $d && LLMSERVE_CACHE=/tmp/cache-$b PYTHONPATH=$d /work/main/.venv/bin/python benchmarks/bandwidth_ceiling.py \
       --repeats 4 --steps 64 2>&1 | grep -E '^\| [0-9]|median|^\| (q/k/v|attention|final norm|residual|gate/up) ')
  done
done
