#!/bin/bash
# warm each build's calibration cache, then alternate
run() { # build model label
  local b=$1 m=$2; local d=/work/main; [ $b = base ] && d=/tmp/base
  (cd $d && LLMSERVE_CACHE=/tmp/cache-$b PYTHONPATH=$d /work/main/.venv/bin/python /work/main/benchmarks/results/startup-s51/healthy_s.py "$b $m $3" --model $m 2>&1 | tail -1)
}
for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  for b in new base; do run $b $m warm; done
  for r in 1 2; do for b in new base; do run $b $m round$r; done; done
done
