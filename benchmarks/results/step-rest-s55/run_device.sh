#!/bin/bash
# The lent GPU machine, one call: the CUDA checks (tests/engine/test_devices.py: every engine mode's greedy tokens against
# transformers on the GPU, and on its CPU) and the CPU kernels' tests on an Intel host with AMX, then issue 20's c=1
# measure on that CPU (two cores pinned, as on this project's 2-core hosts): this tree against the commit before
# (carried as .base: git archive of llmserve, the benchmark and what it imports), alternated.
# Run from the repo root there, carrying .whl (gguf, llguidance) and .base.
set -u
start=$SECONDS
lscpu | grep -E "Model name|^CPU\(s\)|Model:|L3" | cut -c1-120
grep -o -w -E "amx_tile|avx512_vnni|avx512_bf16" /proc/cpuinfo | sort | uniq -c
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
cp -r .base /tmp/base || exit 1
build='from llmserve.kernels import load_cpu_kernels; print("kernels built", load_cpu_kernels())'
(cd /tmp/base && python3 -c "$build" > /tmp/build_base.log 2>&1) &
python3 -c "$build" 2>&1 | tail -2
wait; tail -2 /tmp/build_base.log
echo "built at $((SECONDS - start)) s"
# on cores 2-15, so the pinned runs below are alone on 0,1 afterwards
taskset -c 2-15 timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/engine/test_devices.py tests/kernels \
  --ignore=tests/kernels/test_decode_layer.py 2>&1 | tail -8
echo "tests done at $((SECONDS - start)) s"
run() {  # $1: tree, $2: label
  echo "=== $2 at $((SECONDS - start)) s"
  (cd $1 && taskset -c 0,1 timeout 55 python3 benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads 2 \
     --repeats 5 --out $OUT/$2_$i.json 2>&1 | grep -E '^\| [0-9]|median|^\| (attention|final norm|residual) |Error')
}
for i in 1 2; do
  run $PWD head
  run /tmp/base base
done
echo "done at $((SECONDS - start)) s"
