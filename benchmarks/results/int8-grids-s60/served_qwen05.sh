#!/bin/bash
# Qwen2.5-Coder-0.5B served: the default now (int4 + int8 on the file's grids) and the default before (--quantization
# none: the weights as loaded), one server at a time, issue 6's workload (200-token shared prefix, 256-token prompts,
# 128 out) at c = 1 (8 requests) and c = 8 (16).
D=benchmarks/results/int8-grids-s60
for variant in default none; do
  extra=""; [ "$variant" = none ] && extra="--quantization none"
  .venv/bin/llmserve serve --model qwen2.5-coder-0.5b --port 8391 $extra > $D/served_$variant.server.log 2>&1 &
  pid=$!
  for i in $(seq 120); do curl -sf localhost:8391/health > /dev/null && break; sleep 1; done
  .venv/bin/llmserve bench --base-url http://127.0.0.1:8391 --workload shared-prefix --prefix-len 200 --input-len 256 \
      --output-len 128 --concurrency 1,8 --num-requests 8,16 --warmup 1 --label "$variant" --out $D/served_$variant.json
  kill $pid; wait $pid 2>/dev/null
done
