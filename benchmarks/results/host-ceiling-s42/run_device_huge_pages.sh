#!/bin/bash
# The streamed weights on huge pages (quantization/weight_arena.py) on the lent machine's Intel CPU, two cores
# pinned: SmolLM2's shape with random weights, int4 as its file is served; the two placements alternated in one
# process (benchmarks/decode_step_configs.py), then the default's share of the bandwidth ceiling.
set -u
start=$SECONDS
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLMSERVE_KERNEL_CACHE=/tmp/kernels OMP_NUM_THREADS=2
python3 -c 'from llmserve.kernels import load_cpu_kernels; load_cpu_kernels(); print("kernels built")' 2>&1 | tail -2
python3 -c 'from pathlib import Path; from benchmarks.device_throughput import build; print(build("smollm2-135m", Path("/tmp/shape")))' 2>&1 | tail -1
echo "built at $((SECONDS - start)) s"
m="model=/tmp/shape/smollm2-135m,quantization=int4,device=cpu"
taskset -c 0,1 timeout 200 python3 benchmarks/decode_step_configs.py --config "4k=$m,huge_pages=false" \
  --config "huge=$m,huge_pages=true" --batches 1,8,1,8,1 --repeats 6 2>&1 | grep -E '^\||Error|error'
echo "=== default, share of the ceiling, at $((SECONDS - start)) s"
for i in 1 2; do
  taskset -c 0,1 timeout 60 python3 benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads 2 --repeats 6 2>&1 \
    | grep -E '^\||^\{|median|weight memory|Error|error' | grep -v -- '---'
done
echo "done at $((SECONDS - start)) s"
