#!/bin/bash
# Issue 20's c=1 target on another host type: a lent GPU machine's CPU, two cores pinned (taskset -c 0,1) as on
# this project's 2-core hosts. SmolLM2's shape, random weights, served as its file is (int4 layers, int8 head),
# `benchmarks/bandwidth_ceiling.py`. The build as shipped (weights prefetched into L2 on Intel, non-temporally on
# AMD) alternates with a variant whose vendor test is flipped, to measure the prefetch hint on this CPU.
# Run from the repo root on the lent machine (the `device` tool), carrying .whl (gguf, llguidance).
set -u
start=$SECONDS
lscpu | tee $OUT/lscpu.txt | grep -E "Model name|^CPU\(s\)|Socket|NUMA node\(s\)|L3|Flags" | cut -c1-300
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels
python3 -c "import torch; print('torch', torch.__version__)"
mkdir -p /tmp/v/benchmarks && cp -r llmserve tests /tmp/v && cp benchmarks/*.py /tmp/v/benchmarks/
sed -i 's/static const bool amd = __builtin_cpu_is("amd");/static const bool amd = !__builtin_cpu_is("amd");/' \
  /tmp/v/llmserve/kernels/quantized_gemv.cpp
grep -c '!__builtin_cpu_is("amd")' /tmp/v/llmserve/kernels/quantized_gemv.cpp || exit 1
build='from llmserve.kernels import load_cpu_kernels; load_cpu_kernels(); print("kernels built")'
(cd /tmp/v && python3 -c "$build" > /tmp/build_v.log 2>&1) &
python3 -c "$build" 2>&1 | tail -3
wait; tail -3 /tmp/build_v.log
echo "built at $((SECONDS - start)) s"
run() {  # $1: tree, $2: label, $3: cores, $4: threads
  echo "=== $2 (cores $3, $4 threads) at $((SECONDS - start)) s"
  (cd $1 && taskset -c $3 timeout 120 python3 benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads $4 \
     --repeats 6 2>&1 | grep -E '^\||^\{|median|Error|error' | grep -v -- '---')
}
for i in 1 2 3; do
  run $PWD shipped 0,1 2
  run /tmp/v flipped 0,1 2
done
run $PWD shipped 0-7 8
echo "done at $((SECONDS - start)) s"
