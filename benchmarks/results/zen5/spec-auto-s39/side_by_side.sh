#!/bin/bash
# Session 39: speculation on by default ("auto": n-gram prompt lookup while fewer than 4 requests run, where the one
# native call runs the decoder). Servers up side by side, the peer workload (shared prefix, 256-token prompts, 128
# greedy tokens) alternated between them per round and level:
#   MODEL=smollm2-135m: the default (port 8021) and --speculative-config off (8022)
#   MODEL=qwen2.5-coder-1.5b: the same two (8011, 8013) and llama-server on the Q4_K_M file (8012)
# Usage: MODEL=... LEVELS="1:8 4:16" bash side_by_side.sh ROUNDS   (results under OUT, default this folder)
cd /work/main
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-benchmarks/results/zen5/spec-auto-s39}/$MODEL
mkdir -p $OUT
P=$HOME/peers
if [ $MODEL = smollm2-135m ]; then ON=8021; OFF=8022; PORTS="8021 8022"; TOK=""; else ON=8011; OFF=8013; PORTS="8011 8013 8012"; TOK="--tokenizer $P/models/qwen2.5-coder-1.5b-hf"; fi
.venv/bin/python -m llmserve.cli serve $MODEL --port $ON > $OUT/auto.log 2>&1 &
A=$!
.venv/bin/python -m llmserve.cli serve $MODEL --port $OFF --speculative-config off > $OUT/off.log 2>&1 &
B=$!
L=
if [ $MODEL != smollm2-135m ]; then
  NP=32 PORT=8012 bash /work/shared/peers/servers/llama_server.sh -m $P/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --alias $MODEL > $OUT/llama.log 2>&1 &
  L=$!
fi
for i in $(seq 200); do sleep 3; ok=1; for port in $PORTS; do curl -sf localhost:$port/health >/dev/null || ok=0; done; [ $ok = 1 ] && break; done
for level in ${LEVELS:-1:8}; do
  c=${level%%:*}; n=${level##*:}
  for r in $(seq ${1:-2}); do
    for port in $PORTS; do
      .venv/bin/python -m llmserve.cli bench --base-url http://127.0.0.1:$port --model $MODEL --workload shared-prefix --prefix-len 200 --input-len 256 --output-len 128 --seed $((1234+r)) --temperature 0 --concurrency $c --num-requests $n --warmup 1 $TOK --no-progress --out $OUT/c$c-$port-$r.json 2>&1 | grep "^c=$c " | sed "s/^/round $r port $port /"
    done
  done
done
curl -s localhost:$ON/metrics | grep spec_decode | grep -v "^#" > $OUT/spec_metrics.txt
kill $A $B $L
