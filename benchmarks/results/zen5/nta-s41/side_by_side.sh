#!/bin/bash
# Session 41: weights prefetched non-temporally on AMD (quantized_gemv.cpp) against the commit before, served side
# by side: BASE (a worktree of the commit before, default /tmp/s41/base: its own kernel build) on 8031, this
# checkout on 8032, both with no flags. The peer workload (shared 200-token prefix, 256-token prompts, 128 greedy
# tokens), alternated per round and level.
# Usage: MODEL=... LEVELS="1:8 8:32 32:64" bash side_by_side.sh ROUNDS   (results under OUT, default this folder)
cd /work/main
MODEL=${MODEL:-smollm2-135m}
BASE=${BASE:-/tmp/s41/base}
OUT=${OUT:-benchmarks/results/zen5/nta-s41}/$MODEL
mkdir -p $OUT
TOK=""; [ $MODEL != smollm2-135m ] && TOK="--tokenizer $HOME/peers/models/qwen2.5-coder-1.5b-hf"
(cd $BASE && exec /work/main/.venv/bin/python -m llmserve.cli serve $MODEL --port 8031) > $OUT/base.log 2>&1 &
A=$!
for i in $(seq 200); do sleep 2; curl -sf localhost:8031/health >/dev/null && break; done
.venv/bin/python -m llmserve.cli serve $MODEL --port 8032 > $OUT/nta.log 2>&1 &
B=$!
for i in $(seq 200); do sleep 2; curl -sf localhost:8032/health >/dev/null && break; done
for level in ${LEVELS:-1:8}; do
  c=${level%%:*}; n=${level##*:}
  for r in $(seq ${1:-2}); do
    for port in 8031 8032; do
      .venv/bin/python -m llmserve.cli bench --base-url http://127.0.0.1:$port --model $MODEL --workload shared-prefix --prefix-len 200 --input-len 256 --output-len 128 --seed $((1234+r)) --temperature 0 --concurrency $c --num-requests $n --warmup 1 $TOK --no-progress --out $OUT/c$c-$port-$r.json 2>&1 | grep "^c=$c " | sed "s/^/round $r port $port /"
    done
  done
done
kill $A $B
