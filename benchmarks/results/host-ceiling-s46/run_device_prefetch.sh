#!/bin/bash
# The attention's K/V prefetch into L2 (prefetcht1, this tree) against into L1 (prefetcht0: 8551026, the commit before,
# carried as .base), on the lent GPU machine's Intel CPU, two cores pinned: the attention alone with K/V out of the
# cache (cold_attention.py), then the one-request step against the bandwidth ceiling, builds alternated.
# Run from the repo root there, carrying .whl (gguf, llguidance) and .base.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels
cp -r .base /tmp/base || exit 1
build='from llmserve.kernels import load_cpu_kernels; load_cpu_kernels(); print("kernels built")'
(cd /tmp/base && python3 -c "$build" > /tmp/build_base.log 2>&1) &
python3 -c "$build" 2>&1 | tail -1
wait; tail -1 /tmp/build_base.log
echo "built at $((SECONDS - start)) s"
probe=benchmarks/results/host-ceiling-s46/cold_attention.py
for i in 1 2; do
  for tree in $PWD /tmp/base; do
    echo -n "$(basename $tree) "; (cd $tree && taskset -c 0,1 timeout 60 python3 $probe --rounds 20)
  done
done
echo "probes done at $((SECONDS - start)) s"
run() {  # $1: tree, $2: label
  echo "=== $2 at $((SECONDS - start)) s"
  (cd $1 && taskset -c 0,1 timeout 60 python3 benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads 2 \
     --repeats 6 --out $OUT/$2_$i.json 2>&1 | grep -E '^\| [0-9]|median|\| attention|Error')
}
for i in 1 2 3; do
  run $PWD l2
  run /tmp/base l1
done
echo "done at $((SECONDS - start)) s"
