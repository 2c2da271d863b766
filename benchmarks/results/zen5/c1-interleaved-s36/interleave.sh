#!/bin/bash
# Session 36: llmserve default (this tree, port 8011), llmserve at the commit before the super-block layout
# (a worktree at OLD_TREE, port 8013) and llama-server (the Q4_K_M file as shipped, port 8012) up side by side,
# c=1 bench alternated between the three; OUT = this folder.
# Usage: OLD_TREE=/tmp/oldtree bash interleave.sh ROUNDS
# Session 37 reran it with OUT (another folder), CONC (the concurrency, default 1) and NUM (requests a round).
cd /work/main
OUT=${OUT:-benchmarks/results/zen5/c1-interleaved-s36}
CONC=${CONC:-1}
mkdir -p $OUT
P=$HOME/peers
.venv/bin/python -m llmserve.cli serve qwen2.5-coder-1.5b --port 8011 > $OUT/il-llmserve.log 2>&1 &
LS=$!
(cd $OLD_TREE && PYTHONPATH=$OLD_TREE /work/main/.venv/bin/python -m llmserve.cli serve qwen2.5-coder-1.5b --port 8013 > /work/main/$OUT/il-llmserve-old.log 2>&1) &
LO=$!
NP=32 PORT=8012 bash /work/shared/peers/servers/llama_server.sh -m $P/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --alias qwen2.5-coder-1.5b > $OUT/il-llama.log 2>&1 &
LL=$!
for i in $(seq 200); do sleep 3; curl -sf localhost:8011/health >/dev/null && curl -sf localhost:8012/health >/dev/null && curl -sf localhost:8013/health >/dev/null && break; done
for r in $(seq ${1:-6}); do
  for port in 8011 8012 8013; do
    .venv/bin/python -m llmserve.cli bench --base-url http://127.0.0.1:$port --model qwen2.5-coder-1.5b --workload shared-prefix --prefix-len 200 --input-len 256 --output-len 128 --seed $((1234+r)) --temperature 0 --concurrency $CONC --num-requests ${NUM:-8} --warmup 1 --tokenizer $P/models/qwen2.5-coder-1.5b-hf --no-progress --out $OUT/il-$port-$r.json 2>&1 | grep "^c=$CONC" | sed "s/^/round $r port $port /"
  done
done
pkill -P $LO; kill $LS $LO $LL
