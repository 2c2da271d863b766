#!/bin/bash
# Issue 20's c=1 target on the lent GPU machine's CPU (two cores pinned, as on this project's 2-core hosts), the
# build now against the end of session 42 (30ae7d7, carried as .base, where this host measured 67-68 %), alternated; then the CUDA
# checks (tests/engine/test_devices.py) on its GPU. Run from the repo root there, carrying .whl (gguf, llguidance).
set -u
start=$SECONDS
lscpu | grep -E "Model name|^CPU\(s\)|Model:|L2|L3|Flags" | cut -c1-200
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
cp -r .base /tmp/base || exit 1   # made here: git archive 30ae7d7 llmserve benchmarks/bandwidth_ceiling.py pyproject.toml
build='from llmserve.kernels import load_cpu_kernels; load_cpu_kernels(); print("kernels built")'
(cd /tmp/base && python3 -c "$build" > /tmp/build_base.log 2>&1) &
python3 -c "$build" 2>&1 | tail -2
wait; tail -2 /tmp/build_base.log
echo "built at $((SECONDS - start)) s"
# CUDA first (cores 2-15, so the pinned runs below are alone on 0,1 afterwards)
taskset -c 2-15 timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/engine/test_devices.py 2>&1 | tail -6
echo "cuda tests done at $((SECONDS - start)) s"
run() {  # $1: tree, $2: label
  echo "=== $2 at $((SECONDS - start)) s"
  (cd $1 && taskset -c 0,1 timeout 90 python3 benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads 2 \
     --repeats 6 --out $OUT/$2_$i.json 2>&1 | grep -vE -- '^\|[- |]+$|Warning|warn')
}
for i in 1 2 3; do
  run $PWD head
  run /tmp/base base
done
echo "done at $((SECONDS - start)) s"
